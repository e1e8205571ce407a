"""Start a job's worker processes and watch them: the one launcher of enn.

    results = launch(worker_fn, (job_path,), nprocs=2, run_dir=..., hang_timeout_s=60)

- `worker_fn` is a module-level function (`module:function`); its arguments and its return
  value are JSON. The launcher writes `<run_dir>/launch/job.json` and starts torchrun
  (enn_core.runtime.torchrun) as a child process in a group of its own; torchrun starts
  `nprocs` workers running the one worker entry (enn_core.runtime.entry), which calls the
  function and writes its result to `<run_dir>/results/rank-<r>.json`.
- One worker on one node with no restarts to make is started as that entry directly, a child
  with torchrun's variables for rank 0 of 1 and its output in `<run_dir>/logs/rank-0.log`:
  torchrun's agent would only add an interpreter and its torch import (about 1.3 s on two
  cores, bench/bench_launch.py) and a signal hop. The launcher writes its exit record itself;
  the watchdog, the stop paths and the signal contract are the same.
- This process is the watchdog (enn_core.runtime.watchdog): it reads each rank's heartbeat
  and, when a rank is silent past its phase budget, dumps every rank's stack to
  `<run_dir>/stacks/`, kills the attempt (torchrun restarts it while `max_restarts` allows)
  and raises WorkerError naming the silent rank and its last phase.
- A worker that raises writes `<run_dir>/errors/rank-<r>.json`; its error class, message and
  rank reach the caller (domain errors keep their class so retry rules still apply); a rank
  that died below Python is named with its exit code or signal (torchrun's record).
- torchrun, or the one worker started directly, is a child of the process table
  (enn_core.runtime.children); the workers are found and killed by pid and start time,
  never by command line.
- Stop now: Ctrl-C, `cancel.set()` or the overall `timeout_s` kill every worker within
  seconds (the last committed checkpoint is kept). A scheduler's warning (SIGTERM to this
  process, `request_graceful_stop()`) is forwarded to torchrun, which forwards it to the
  workers and kills them after SHUTDOWN_TIMEOUT_S: they save at the next step boundary.
- Logs: each rank's stdout/stderr under `<run_dir>/logs/` (torchrun's), torchrun's own lines
  and torch's C++ logs in `<run_dir>/logs/torchrun.log`, never the console.

Multi-node: every node calls launch() with the same `nnodes`, `rdzv_endpoint` (host:port,
served by the node whose address it names) and `rdzv_id`. The c10d rendezvous orders the
agents by their node descriptor, not by any user-given node rank; node k's workers get the
global ranks after those of nodes 0..k-1. Each node watches and returns only its own
workers: heartbeats, error records and logs are per node (a run_dir of the node's own), and
the returned dict holds this node's global ranks only (`0 not in result` on the nodes that
did not get global rank 0). The nodes do not share the workers' store (torch's shared store
keys attempts by a restart count the nodes need not agree on); rank 0 hosts a fresh one per
round.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from enn_core import errors
from enn_core.atomic import write_json
from enn_core.config.runtime import RuntimeConfig, check_rendezvous
from enn_core.errors import WorkerError
from enn_core.runtime import children, secret
from enn_core.runtime.dist import STALE_ENV
from enn_core.runtime.entry import RESULTS, read_results
from enn_core.runtime.heartbeat import CANCEL_FILE, HEARTBEATS, STACKS, read_heartbeats
from enn_core.runtime.parent import (
    clear_graceful_stop,
    graceful_stop_requested,
    request_graceful_stop,
    spawned_env,
)
from enn_core.runtime.stores import NO_SHARED_STORE
from enn_core.runtime.torchrun import EXITS, WAITING
from enn_core.runtime.watchdog import (
    DEFAULT_BUDGETS,
    ERRORS,
    Verdict,
    Watchdog,
    dump_stacks,
    killed,
    killed_line,
    read_errors,
    worker_error,
    write_error,
)

__all__ = [
    "DEFAULT_BUDGETS",
    "Rendezvous",
    "Verdict",
    "Watchdog",
    "free_port",
    "launch",
    "read_errors",
    "request_graceful_stop",
    "worker_error",
    "write_error",
]

log = logging.getLogger("enn.launch")
LAUNCH = "launch"  # <run_dir>/launch/: the job file and torchrun's record of how it ended
# How long workers told to stop by a scheduler may take to save and leave (torchrun's
# --shutdown-timeout, its default) before they are killed.
SHUTDOWN_TIMEOUT_S = 30.0
# Variables torchrun's child gets from enn, none from the caller's environment: torch's C++
# logs (the c10d "hostname of the client socket" lines) only at ERROR, into the log file.
CHILD_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1"}
LIVENESS_FLOOR_S = 15.0
# torchrun's record of a rendezvous error names its class first (enn_core.runtime.torchrun):
# these are not worth a retry (enn_core.runtime.store_auth)
NOT_RETRIED = ("UnauthenticatedWrite", "RendezvousNodesDiffer")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Rendezvous:
    """Where the agents of one job meet: one node (the default) or `nnodes` machines."""

    nnodes: int = 1
    endpoint: str = ""  # host:port; empty = a free loopback port
    run_id: str = ""  # the job id all nodes share; empty = a fresh one (one node only)
    local_addr: str = ""  # this node's address for the others; empty = its hostname
    timeout_s: float = 120.0  # how long the nodes wait for each other

    def __post_init__(self) -> None:
        check_rendezvous(self.nnodes, self.endpoint, self.run_id)

    @classmethod
    def of(cls, runtime: RuntimeConfig) -> Rendezvous:
        """The rendezvous the runtime config asks for."""
        return cls(
            nnodes=runtime.nnodes,
            endpoint=runtime.rdzv_endpoint,
            run_id=runtime.rdzv_id,
            local_addr=runtime.local_addr,
            timeout_s=runtime.rdzv_timeout_s,
        )

    def resolved(self) -> Rendezvous:
        """This launch's rendezvous: endpoint and run id filled in; one node on loopback."""
        one = self.nnodes == 1
        return Rendezvous(
            nnodes=self.nnodes,
            endpoint=self.endpoint or f"127.0.0.1:{free_port()}",
            run_id=self.run_id or f"enn-{uuid.uuid4().hex[:12]}",
            # one node: the workers' store on loopback; several: each node's own address
            local_addr=self.local_addr or ("127.0.0.1" if one else ""),
            timeout_s=self.timeout_s,
        )


def entry_of(fn: Callable[..., Any] | str) -> str:
    """`module:function` of a module-level function (what the worker entry imports); a
    string is that already (a caller whose process need not import the worker's module)."""
    if isinstance(fn, str):
        if ":" not in fn:
            raise TypeError(f"launch() needs `module:function`, not {fn!r}")
        return fn
    name = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", "")
    if not module or not name or "<" in name or module == "__main__":
        raise TypeError(f"launch() needs a module-level function, not {fn!r}")
    return f"{module}:{name}"


def launch(  # noqa: PLR0913  the stages' and tests' keyword API, kept as it is
    fn: Callable[..., Any] | str,
    args: tuple[Any, ...],
    *,
    nprocs: int,
    run_dir: str | Path,
    hang_timeout_s: float,
    budgets: dict[str, float] | None = None,
    max_restarts: int = 0,
    start_method: str = "spawn",  # noqa: ARG001  torchrun starts workers as fresh processes
    timeout_s: float | None = None,
    cancel: threading.Event | None = None,
    poll_s: float = 0.25,
    rdzv: Rendezvous | None = None,
) -> dict[int, Any]:
    """Run `fn(*args)` in `nprocs` workers of this node; returns {global rank: value} for this
    node's workers (all ranks on one node; see the module docstring for several)."""
    run_dir = Path(run_dir)
    rdzv = (rdzv or Rendezvous()).resolved()
    job = Job(entry_of(fn), list(args), nprocs, run_dir, max_restarts, rdzv, hang_timeout_s)
    # On several nodes the workers start only when the last node has joined the rendezvous.
    wait = rdzv.timeout_s if rdzv.nnodes > 1 else 0.0
    watchdog = Watchdog(
        run_dir,
        nprocs,
        hang_timeout_s,
        {**DEFAULT_BUDGETS, **(budgets or {})},
        local_only=rdzv.nnodes > 1,
        rendezvous_s=wait,
    )
    deadline = time.time() + timeout_s if timeout_s else None
    clear_graceful_stop()
    job.start()
    try:
        while job.running(poll_s):
            if cancel is not None and cancel.is_set():
                job.stop("cancelled")
            elif deadline is not None and time.time() > deadline:
                job.stop(f"timed out after {timeout_s:.0f} s (runtime.task_timeout_s)")
            elif job.stopped is None:
                verdict = watchdog.check(job.started)
                if verdict is not None:
                    job.stop_hung(verdict)
                    watchdog.restarting()
    except BaseException:  # Ctrl-C, SIGTERM: no worker may outlive us
        if graceful_stop_requested():
            job.leave_gracefully()
        job.stop("interrupted")
        raise
    return job.result()


class Job:
    """torchrun's child process and the workers it started."""

    def __init__(  # noqa: PLR0913
        self,
        entry: str,
        args: list[Any],
        nprocs: int,
        run_dir: Path,
        max_restarts: int,
        rdzv: Rendezvous,
        hang_timeout_s: float = 0.0,
    ) -> None:
        self.entry, self.args, self.nprocs, self.run_dir = entry, args, nprocs, run_dir
        self.max_restarts, self.rdzv = max_restarts, rdzv
        # a node whose liveness beat (enn_core.runtime.stores) is older than this is named
        # silent by the others; at least LIVENESS_FLOOR_S, so a loaded machine's late beat
        # is not a partition
        self.liveness_s = max(hang_timeout_s, LIVENESS_FLOOR_S)
        self.run_id = rdzv.run_id
        self.started = time.time()
        self.stopped: str | None = None
        self.verdicts: list[Verdict] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.child: children.Child | None = None  # torchrun, or the worker started directly
        self.own_group = False
        # one worker of one node that is never restarted: no agent needed (module docstring)
        self.direct = nprocs == 1 and rdzv.nnodes == 1 and max_restarts == 0
        self.said_waiting = ""  # the rendezvous's last "still waiting" line shown

    def start(self) -> None:
        for sub in (ERRORS, "logs", HEARTBEATS, STACKS, RESULTS, LAUNCH):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        for old in [  # an earlier launch's records (a retry runs in the same folder)
            *(self.run_dir / RESULTS).glob("rank-*.json"),
            *(self.run_dir / HEARTBEATS).glob("rank-*.json"),
            *(self.run_dir / ERRORS).glob("rank-*.json"),
            *(self.run_dir / STACKS).glob("rank-*"),
            self.run_dir / LAUNCH / EXITS,
            self.run_dir / LAUNCH / WAITING,
            self.run_dir / CANCEL_FILE,
        ]:
            old.unlink(missing_ok=True)
        job_path = self.run_dir / LAUNCH / "job.json"
        write_json(
            job_path,
            {
                "entry": self.entry,
                "args": self.args,
                "run_dir": str(self.run_dir),
                "nprocs": self.nprocs,
                "max_restarts": self.max_restarts,
                "rendezvous": asdict(self.rdzv),
                "shutdown_timeout_s": SHUTDOWN_TIMEOUT_S,
                "liveness_timeout_s": self.liveness_s,
            },
        )
        self.own_group = in_terminal_foreground()
        env = child_env(self.run_dir, self.rdzv.nnodes)
        command = [sys.executable, "-m", "enn_core.runtime.torchrun", str(job_path)]
        log_file = self.run_dir / "logs" / "torchrun.log"
        kind = "torchrun"
        if self.direct:
            kind = "worker"
            command = [sys.executable, "-m", "enn_core.runtime.entry", str(job_path)]
            log_file = self.run_dir / "logs" / "rank-0.log"
            env.update(one_worker_env(self.rdzv))
        self.child = children.start(kind, command, env=env, log=log_file, session=self.own_group)
        self.proc = self.child.proc
        self.started = time.time()

    def running(self, poll_s: float) -> bool:
        assert self.proc is not None
        try:
            self.proc.wait(poll_s)
            alive = False
        except subprocess.TimeoutExpired:
            alive = True
        if self.rdzv.nnodes > 1:
            self.show_waiting()
        return alive

    def show_waiting(self) -> None:
        """The rendezvous's newest "still waiting for N more node(s)" line (torchrun's child
        writes it; its own output goes to the log file), on the console once."""
        with contextlib.suppress(OSError), open(self.run_dir / LAUNCH / WAITING) as f:
            line = f.read(1000).strip()  # one line, however large the file
            if line and line != self.said_waiting:
                self.said_waiting = line
                log.warning("%s", line)

    def workers(self) -> set[children.Proc]:
        """The workers, by pid and start time: the descendants of torchrun (each worker has a
        session of its own); started directly, the worker too while it is not reaped."""
        assert self.child is not None
        own = {self.child.record} if self.direct and self.child.proc.returncode is None else set()
        return own | children.tree(self.child)

    def pids(self) -> set[int]:
        return {p.pid for p in self.workers()}

    def kill_workers(self) -> set[int]:
        return children.kill(self.workers())

    def stop(self, reason: str) -> None:
        """Stop now: every worker and torchrun killed (children.stop); restarted workers exit
        at once."""
        if self.stopped is None:
            self.stopped = reason
            (self.run_dir / CANCEL_FILE).touch()
        assert self.child is not None
        children.stop(self.child)

    def leave_gracefully(self) -> None:
        """SIGTERM to torchrun (not its group), which forwards it to the workers and kills them
        after the shutdown timeout; wait that long (and a little) for it to end."""
        assert self.child is not None
        log.info("forwarding SIGTERM to the workers; they have %.0f s to save", SHUTDOWN_TIMEOUT_S)
        children.terminate(self.child, SHUTDOWN_TIMEOUT_S + 5, to_group=False)

    def stop_hung(self, verdict: Verdict) -> None:
        self.verdicts.append(verdict)
        ours = self.pids()
        beats = read_heartbeats(self.run_dir)
        dump_stacks(self.run_dir, {r: h for r, h in beats.items() if int(h["pid"]) in ours})
        log.error("watchdog: %s", verdict.message(self.run_dir))
        if len(self.verdicts) > self.max_restarts:
            self.stop(verdict.message(self.run_dir))
        else:  # torchrun's agent restarts the group
            self.kill_workers()

    def ended(self) -> dict[str, Any]:
        """torchrun's record of how the job ended (enn_core.runtime.torchrun); a worker started
        directly gets the same record from its exit code (negative: the signal)."""
        path = self.run_dir / LAUNCH / EXITS
        if self.direct and self.proc is not None and self.proc.returncode is not None:
            code = self.proc.returncode
            record: dict[str, Any] = {"state": "succeeded", "exits": {}, "message": ""}
            if code != 0:
                record = {"state": "failed", "exits": {"0": code}, "message": f"rank 0 exit {code}"}
            write_json(path, record)
            return record
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            tail = _tail(self.run_dir / "logs" / "torchrun.log")
            code = self.proc.returncode if self.proc is not None else None
            return {"state": "error", "exits": {}, "message": f"torchrun exited {code}: {tail}"}

    def result(self) -> dict[int, Any]:
        ended = self.ended()
        if ended["state"] == "succeeded" and self.stopped is None:  # a restart may have saved it
            return read_results(self.run_dir)
        if self.verdicts:
            attempts = "; ".join(
                f"attempt {i}: {v.message(self.run_dir)}" for i, v in enumerate(self.verdicts)
            )
            raise WorkerError(attempts)
        if self.stopped is not None:
            raise WorkerError(
                f"distributed job {self.run_id} {self.stopped}; every worker was killed"
            )
        err = self.rendezvous_error(ended)
        code = self.proc.returncode if self.proc is not None else None
        if err is None and ended["state"] == "error" and code is not None and killed(code):
            err = errors.OutOfMemory(  # torchrun itself (its workers die with it)
                killed_line("torchrun (the workers' agent)", code, "", self.run_dir / "logs")
            )
        if err is None:
            exits = {int(r): int(c) for r, c in ended["exits"].items()}
            err = worker_error(self.run_dir, ended["message"], None, exits)
            if self.rdzv.nnodes > 1:  # this node's records only: a victim's error may be all
                err = type(err)(
                    f"{err} [node-local view of {self.rdzv.nnodes}-node job {self.run_id}: "
                    "the root cause may be in another node's run directory]"
                )
        raise err

    def rendezvous_error(self, ended: dict[str, Any]) -> errors.EnnError | None:
        """The nodes did not meet: a peer never came (transient), or the id was used up; or
        mid-job a peer went silent or this node was cut off from the store (transient)."""
        if ended["state"] == "rendezvous_closed":
            return errors.ConfigError(
                f"runtime.rdzv_id={self.run_id} belongs to a job that already ended at "
                f"{self.rdzv.endpoint}; pick a new runtime.rdzv_id and pass it to every node"
            )
        if ended["state"] == "rendezvous_error" and ended["message"].startswith(NOT_RETRIED):
            # a forged value in the store, or nodes counting differently: no retry mends it
            return errors.ConfigError(f"rendezvous {self.run_id}: {ended['message']}")
        if ended["state"] == "peer_silent":  # this node's liveness beat stopped its workers
            return errors.TransientError(
                f"rendezvous {self.run_id}: {ended['message']}; once that node (or the network) "
                "is back, run the same command on every node again (it resumes from the last "
                "committed checkpoint)"
            )
        if ended["state"] == "cut_off":
            return errors.TransientError(
                f"rendezvous {self.run_id}: {ended['message']}; check this node's network to "
                f"{self.rdzv.endpoint}, then run the same command on every node again (it "
                "resumes from the last committed checkpoint)"
            )
        if ended["state"] == "rendezvous_error":
            return errors.TransientError(
                f"rendezvous {self.run_id} at {self.rdzv.endpoint}: {ended['message']}; "
                f"start all {self.rdzv.nnodes} nodes within runtime.rdzv_timeout_s="
                f"{self.rdzv.timeout_s:.0f} with the same runtime.rdzv_endpoint and "
                "runtime.rdzv_id"
            )
        return None


def secret_home(run_dir: Path) -> Path:
    """Where a one-node job's own secret lives: the work directory of a stage's run directory
    (`work/runs/<run id>/<stage>/`), so a resumed run's kept prediction parts stay valid;
    any other run directory (a test's, a benchmark's) keeps its own."""
    return run_dir.parents[2] if run_dir.parent.parent.name == "runs" else run_dir


def in_terminal_foreground() -> bool:
    """Whether this process's group is a terminal's foreground group: then torchrun gets a
    session of its own, so that a Ctrl-C typed there reaches only enn (which stops the job at
    once) and not torchrun (which would forward it and wait for the workers to leave).
    Otherwise torchrun stays in this process's group: a tuning trial's, or a scheduler's,
    where a signal to the group reaches it too. Either way it dies with this process."""
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                return True
    return False


def child_env(run_dir: Path, nnodes: int) -> dict[str, str]:
    """torchrun's environment: this one without a previous job's distributed variables, the
    caller's import path (tests' and benchmarks' modules), torch's C++ logs at ERROR; on
    several nodes rank 0 hosts a fresh workers' store each round. The job secret
    (ENN_JOB_SECRET_FILE, enn_core/runtime/secret.py): the one configured, checked now; on
    one node without one, the work directory's own (made once, 0600); several nodes without
    one are refused in one line before anything starts."""
    env = {k: v for k, v in os.environ.items() if k not in (*STALE_ENV, NO_SHARED_STORE)}
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    given = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*paths, *given]))
    env.update(CHILD_ENV)
    env.update(secret.launch_env(secret_home(run_dir), nnodes, env))
    if nnodes > 1:
        env[NO_SHARED_STORE] = "1"
    return spawned_env(env)


def one_worker_env(rdzv: Rendezvous) -> dict[str, str]:
    """What torchrun's agent gives the only worker of a one-node job: rank 0 of 1, hosting
    the workers' store itself on the rendezvous's loopback endpoint (no agent store)."""
    host, _, port = rdzv.endpoint.rpartition(":")
    one = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK")
    sizes = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE")
    return {
        **dict.fromkeys(one, "0"),
        **dict.fromkeys(sizes, "1"),
        "ROLE_NAME": "default",
        "MASTER_ADDR": host,
        "MASTER_PORT": port,
        "TORCHELASTIC_RUN_ID": rdzv.run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no torchrun log"
    return " | ".join(line.strip() for line in text[-lines:]) or "no output"
