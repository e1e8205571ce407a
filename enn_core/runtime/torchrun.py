"""torchrun as enn runs it: `python -m enn_core.runtime.torchrun <run_dir>/launch/job.json`.

The enn launcher (enn_core.runtime.launch) starts this module as a child in a process group
of its own; it is torchrun (torch.distributed.run's own argument parser and elastic agent,
with the enn-c10d rendezvous backend) plus what enn needs around it:

- it dies with the enn process (enn_core.runtime.parent), and each worker it starts dies
  with it (the worker entry does the same), so a SIGKILLed `enn` leaves nothing running;
- the workers run the one worker entry, `python -m enn_core.runtime.entry <job.json>`;
- the signals a scheduler sends (SIGTERM, SIGUSR2; never SIGUSR1, the stack dump) are
  forwarded to the workers (`--signals-to-handle`), which then have `--shutdown-timeout`
  seconds to save at a step boundary and leave before torchrun kills them;
- `<run_dir>/launch/exits.json` records how the job ended: `succeeded`, `failed` with each
  failed rank's exit code (negative: the signal), `peer_silent` (failed, because this node's
  liveness beat stopped its workers: another node went silent, or the store did; the line
  names it), `rendezvous_closed` (a used-up rendezvous id), `rendezvous_error` (the nodes did
  not meet), `cut_off` (this node lost the rendezvous store mid-job:
  enn_core.runtime.liveness ends the agent, which torch cannot) or `error`, with one line.

torchrun's own lines and torch's C++ logs go to `<run_dir>/logs/torchrun.log` (the launcher
redirects this process's output; TORCH_CPP_LOG_LEVEL=ERROR), never the console. The one
exception is the rendezvous's "still waiting for N more node(s)" line: its newest is kept in
`<run_dir>/launch/waiting.txt`, which the launcher shows on the console, and a rendezvous that
times out says whom it was still waiting for.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from enn_core.atomic import atomic_file, write_json
from enn_core.runtime.liveness import stopped_workers, when_cut_off
from enn_core.runtime.parent import die_with_parent, exit_process, spawned_env
from enn_core.runtime.stores import WAITING_EXTRA, register_rendezvous
from enn_core.runtime.stores import log as rendezvous_log

EXITS = "exits.json"
WAITING = "waiting.txt"
NO_DETAIL = "no detail"
# Forwarded to the workers by torchrun's agent. SIGINT and SIGHUP: a terminal's, if one
# reaches this process group; SIGUSR1 is never here: it makes a worker dump its stack.
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"


def argv_of(job: dict[str, Any], job_path: Path) -> list[str]:
    """torchrun's command line for the job the launcher wrote."""
    rdzv = job["rendezvous"]
    return [
        f"--nnodes={rdzv['nnodes']}",
        f"--nproc-per-node={job['nprocs']}",
        f"--rdzv-backend={register_rendezvous()}",
        f"--rdzv-endpoint={rdzv['endpoint']}",
        f"--rdzv-id={rdzv['run_id']}",
        f"--rdzv-conf=join_timeout={int(rdzv['timeout_s'])}"
        f",liveness_timeout={int(job['liveness_timeout_s'])}",
        *([f"--local-addr={rdzv['local_addr']}"] if rdzv["local_addr"] else []),
        f"--max-restarts={job['max_restarts']}",
        "--monitor-interval=0.1",
        f"--log-dir={Path(job['run_dir']) / 'logs'}",
        "--redirects=3",
        f"--signals-to-handle={SIGNALS}",
        f"--shutdown-timeout={int(job['shutdown_timeout_s'])}",
        "--module",
        "enn_core.runtime.entry",
        str(job_path),
    ]


class WaitingLine(logging.Handler):
    """The rendezvous's newest "still waiting" line, written for the launcher to show."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.WARNING)
        self.path, self.last = path, ""

    def emit(self, record: logging.LogRecord) -> None:
        if (who := getattr(record, WAITING_EXTRA, None)) is None:
            return
        self.last = str(who)
        with contextlib.suppress(OSError), atomic_file(self.path) as f:
            f.write(record.getMessage() + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent()
    os.environ.update(spawned_env({}))  # the workers' parent: torch's agent copies os.environ
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    job_path = Path(argv[0])
    job = json.loads(job_path.read_text())
    out = job_path.parent / EXITS
    out.unlink(missing_ok=True)
    when_cut_off(lambda line: write_json(out, {"state": "cut_off", "exits": {}, "message": line}))
    waiting = WaitingLine(job_path.parent / WAITING)
    rendezvous_log.addHandler(waiting)

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    config, cmd, cmd_args = config_from_args(parse_args(argv_of(job, job_path)))
    try:
        elastic_launch(config, cmd)(*cmd_args)
    except ChildFailedError as e:
        exits = {str(rank): f.exitcode for rank, f in e.failures.items()}
        what = ", ".join(f"rank {r} exit {c}" for r, c in sorted(exits.items()))
        if (why := stopped_workers()) is not None:  # killed by this node, not by a crash
            write_json(out, {"state": "peer_silent", "exits": exits, "message": why})
            return 1
        write_json(out, {"state": "failed", "exits": exits, "message": what})
        return 1
    except RendezvousClosedError as e:
        write_json(out, {"state": "rendezvous_closed", "exits": {}, "message": _first(e)})
        return 1
    except RendezvousError as e:
        said = _first(e)
        if said == NO_DETAIL and waiting.last:
            said = f"still waiting for {waiting.last}"
        what = f"{type(e).__name__} ({said})"
        write_json(out, {"state": "rendezvous_error", "exits": {}, "message": what})
        return 1
    except BaseException as e:  # a signal torchrun handled (SignalException), or its own bug
        write_json(
            out, {"state": "error", "exits": {}, "message": f"{type(e).__name__}: {_first(e)}"}
        )
        raise
    write_json(out, {"state": "succeeded", "exits": {}, "message": ""})
    return 0


def _first(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else NO_DETAIL


if __name__ == "__main__":
    exit_process(main())
