"""torchrun as a batch script runs it (deploy/slurm/train.sbatch):

    python -m flows.torchrun --log=FILE <torchrun's own arguments>

FILE may hold `{host}`, this node's host name (srun starts one per node, with the same
arguments).

Stock torchrun ends a job that a signal stopped with exit 1 and a traceback on stderr (its
SignalException), which a batch job's output then shows as a failure. Here, around the same
torchrun (torch.distributed.run, the enn-c10d rendezvous backend by its entry point):

- torchrun's own lines and any traceback go to FILE, never the job's output; the workers'
  lines (rank 0's stage console) still reach the output as before;
- a job stopped by SIGTERM or SIGUSR2 (preemption, `scontrol requeue`, `scancel`, the
  time-limit warning) after torchrun forwarded the signal to its workers, which save a
  committed checkpoint and end with 12, ends with exit 12 too (enn_core.errors.Preempted:
  "resume me") and one line;
- a failed worker is one line naming each failed rank's exit code and FILE.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from pathlib import Path

from enn_core.atomic import open_own
from enn_core.errors import DataError, Preempted

PREEMPTED = Preempted.exit_code
# the signals a scheduler sends to stop a job that should resume
RESUMABLE = (signal.SIGTERM, signal.SIGUSR2)
log = logging.getLogger("enn.torchrun")


def _say(line: str) -> None:
    print(f"torchrun: {line}", file=sys.stderr, flush=True)


def _to_file(handler: logging.Handler) -> None:
    """torch's loggers print through stderr handlers of their own (torch._logging, one on each
    of many loggers that do not propagate): each goes to `handler` instead, as the root does."""
    root = logging.getLogger()
    loggers = [root, *(lg for lg in logging.Logger.manager.loggerDict.values())]
    for logger in loggers:
        if not isinstance(logger, logging.Logger):
            continue
        streams = [
            h for h in logger.handlers if type(h) is logging.StreamHandler and h is not handler
        ]
        for h in streams:
            logger.removeHandler(h)
        if streams or logger is root:
            logger.addHandler(handler)
    root.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not argv[0].startswith("--log="):
        _say("usage: python -m flows.torchrun --log=FILE <torchrun arguments>")
        return 2
    log_path = Path(argv[0].split("=", 1)[1].replace("{host}", socket.gethostname()))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:  # a shared folder: never through a link planted there (atomic.open_own)
        stream = os.fdopen(open_own(log_path), "a", buffering=1)
    except DataError as e:
        _say(str(e))
        return e.exit_code
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    _to_file(handler)

    try:
        torchrun(argv[1:])
    except SignalException as e:
        log.exception("torchrun stopped by %s", e.sigval.name)
        if e.sigval in RESUMABLE:
            _say(
                f"{e.sigval.name}: forwarded to the workers, which save a committed checkpoint "
                f"and stop (exit {PREEMPTED}: preempted, resume me); torchrun's log: {log_path}"
            )
            return PREEMPTED
        _say(f"stopped by {e.sigval.name}; torchrun's log: {log_path}")
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        log.exception("a worker failed")
        codes = {rank: f.exitcode for rank, f in sorted(e.failures.items())}
        if set(codes.values()) == {PREEMPTED}:
            _say(f"the workers saved and stopped (exit {PREEMPTED}: preempted, resume me)")
            return PREEMPTED
        what = ", ".join(f"rank {r} exit {c}" for r, c in codes.items())
        _say(f"workers failed ({what}); torchrun's log: {log_path}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
