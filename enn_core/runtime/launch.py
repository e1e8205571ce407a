"""Launch N worker processes through torch.distributed.elastic and watch them.

    results = launch(worker_fn, (job_path,), nprocs=2, run_dir=..., hang_timeout_s=60)

- Each job gets a free loopback port and a unique rendezvous id; stale distributed variables
  are removed from the environment the workers inherit.
- The agent runs in a helper thread (so this works from Prefect's worker threads and the
  caller's thread stays free); the calling thread is the watchdog: it reads each rank's
  heartbeat (enn_core.runtime.heartbeat) and, when a rank is silent past its phase budget,
  dumps every rank's stack to `<run_dir>/stacks/`, kills the attempt and raises WorkerError
  naming the silent rank and its last phase, not the peer waiting for it in a collective.
- A worker that raises writes `<run_dir>/errors/rank-<r>.json`; its error class, message and
  rank reach the caller (domain errors keep their class so retry rules still apply).
- Ctrl-C, `cancel.set()` or the overall `timeout_s` kill every worker within seconds.
- Per-rank stdout/stderr go to `<run_dir>/logs/`.

Restarts (`max_restarts`) use the agent's own loop; the per-attempt PrefixStore in
enn_core.runtime.dist is the restart-race fix from FIELD_NOTES.

Multi-node: every node calls launch() with the same `nnodes`, `rdzv_endpoint` (host:port,
served by the node whose address it names) and `rdzv_id`. The c10d rendezvous orders the
agents by their node descriptor (address, pid), not by any user-given node rank; node k's
workers get the global ranks after those of nodes 0..k-1. Each agent watches and returns
only its own workers: heartbeats, error records and logs are per node (use a run_dir of
the node's own), and the returned dict holds this node's global ranks only, so the
node that did not get global rank 0 has no rank-0 summary (`0 not in result`). The agents
do not share the workers' store across nodes (torch's shared store keys attempts by a
restart count the nodes need not agree on); rank 0 hosts a fresh one per round.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError

from enn_core import errors
from enn_core.config.runtime import RuntimeConfig, check_rendezvous
from enn_core.errors import WorkerError
from enn_core.runtime.dist import STALE_ENV
from enn_core.runtime.heartbeat import CANCEL_FILE, read_heartbeats, stack_path
from enn_core.runtime.stores import NO_SHARED_STORE, register_rendezvous

log = logging.getLogger("enn.launch")
ERRORS = "errors"

# Phases with their own budget (seconds) instead of hang_timeout: slow by nature.
DEFAULT_BUDGETS = {"spawn": 90.0, "compile": 300.0, "checkpoint": 300.0}


@dataclass
class Verdict:
    """Why an attempt was ended by the watchdog."""

    rank: int | None  # None: a worker of this node whose global rank is not known yet
    phase: str
    step: int | None
    silent_s: float
    frame: str
    waiting: list[int] = field(default_factory=list)

    def message(self, run_dir: Path) -> str:
        step = f" step {self.step}" if self.step is not None else ""
        peers = (
            f"; rank(s) {self.waiting} were waiting for it in a collective" if self.waiting else ""
        )
        who = f"rank {self.rank}" if self.rank is not None else "a worker of this node"
        return (
            f"{who} hung in phase {self.phase}{step} (no progress for {self.silent_s:.0f} s, "
            f"at {self.frame or 'unknown frame'}){peers}; "
            f"stacks of every rank in {run_dir / 'stacks'}"
        )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def clean_dist_env(shared_store: bool = True) -> Iterator[None]:
    """Remove stale distributed variables while the agent spawns workers; restore after.

    `shared_store=False` (multi-node) makes rank 0 host a fresh workers' store each round."""
    keys = (*STALE_ENV, NO_SHARED_STORE)
    saved = {k: os.environ.pop(k) for k in keys if k in os.environ}
    if not shared_store:
        os.environ[NO_SHARED_STORE] = "1"
    try:
        yield
    finally:
        os.environ.pop(NO_SHARED_STORE, None)
        os.environ.update(saved)


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

    def resolved(self) -> tuple[str, str]:
        """(endpoint, run id) for this launch."""
        return (
            self.endpoint or f"127.0.0.1:{free_port()}",
            self.run_id or f"enn-{uuid.uuid4().hex[:12]}",
        )


def launch(  # noqa: PLR0913  the stages' and tests' keyword API, kept as it is
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    nprocs: int,
    run_dir: str | Path,
    hang_timeout_s: float,
    budgets: dict[str, float] | None = None,
    max_restarts: int = 0,
    start_method: str = "spawn",
    timeout_s: float | None = None,
    cancel: threading.Event | None = None,
    poll_s: float = 0.25,
    rdzv: Rendezvous | None = None,
) -> dict[int, Any]:
    """Run `fn(*args)` in `nprocs` elastic workers on this node; returns {global rank: value}
    for this node's workers (all ranks on one node; see the module docstring for several)."""
    run_dir = Path(run_dir)
    rdzv = rdzv or Rendezvous()
    for sub in (ERRORS, "logs", "heartbeats", "stacks"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    (run_dir / CANCEL_FILE).unlink(missing_ok=True)
    job = _Job(fn, args, nprocs, run_dir, max_restarts, start_method, rdzv)
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
    job.start()
    try:
        while job.thread.is_alive():
            job.thread.join(poll_s)
            if cancel is not None and cancel.is_set():
                job.stop("cancelled")
            elif deadline is not None and time.time() > deadline:
                job.stop(f"timed out after {timeout_s:.0f} s (runtime.task_timeout_s)")
            elif job.stopped is None:
                verdict = watchdog.check(job.started)
                if verdict is not None:
                    job.stop_hung(verdict)
                    watchdog.restarting()
    except BaseException:  # Ctrl-C or the thread's cancellation: no worker may outlive us
        job.stop("interrupted")
        job.thread.join(30.0)  # let the agent thread end before interpreter exit
        raise
    return job.result(watchdog)


class _Job:
    """The agent thread and the worker processes it started."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        nprocs: int,
        run_dir: Path,
        max_restarts: int,
        start_method: str,
        rdzv: Rendezvous,
    ) -> None:
        self.fn, self.args, self.nprocs, self.run_dir = fn, args, nprocs, run_dir
        self.max_restarts, self.start_method, self.rdzv = max_restarts, start_method, rdzv
        self.endpoint, self.run_id = rdzv.resolved()
        self.started = time.time()
        self.stopped: str | None = None
        self.verdicts: list[Verdict] = []
        self.outcome: dict[int, Any] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"enn-agent-{self.run_id}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        n = self.rdzv.nnodes
        cfg = LaunchConfig(
            min_nodes=n,
            max_nodes=n,
            nproc_per_node=self.nprocs,
            run_id=self.run_id,
            rdzv_backend=register_rendezvous(),  # c10d on a store bound to the endpoint
            rdzv_endpoint=self.endpoint,
            # one node: the workers' store on loopback; several: each node's own address
            local_addr=self.rdzv.local_addr or ("127.0.0.1" if n == 1 else None),
            rdzv_configs={"join_timeout": int(self.rdzv.timeout_s)},
            max_restarts=self.max_restarts,
            monitor_interval=0.1,
            start_method=self.start_method,
            logs_specs=DefaultLogsSpecs(log_dir=str(self.run_dir / "logs"), redirects=Std.ALL),
        )
        try:
            with clean_dist_env(shared_store=n == 1):
                self.outcome = elastic_launch(cfg, self.fn)(*self.args)
        except BaseException as e:  # reported to the caller by result()
            self.error = e

    def pids(self) -> set[int]:
        """Worker pids: heartbeat pids and spawned children started by this job, all of them
        processes of ours (a heartbeat's pid may be reused, or another machine's)."""
        pids: set[int] = set()
        beating = {int(h["pid"]) for h in read_heartbeats(self.run_dir).values()}
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    cmd = " ".join(child.cmdline())
                    if child.pid in beating or (
                        child.create_time() >= self.started - 1
                        and ("spawn_main" in cmd or "forkserver" in cmd)
                    ):
                        pids.add(child.pid)
        return pids

    def kill(self) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def stop(self, reason: str) -> None:
        if self.stopped is None:
            self.stopped = reason
            (self.run_dir / CANCEL_FILE).touch()  # restarted workers exit at once
        self.kill()

    def stop_hung(self, verdict: Verdict) -> None:
        self.verdicts.append(verdict)
        ours = self.pids()
        beats = read_heartbeats(self.run_dir)
        dump_stacks(self.run_dir, {r: h for r, h in beats.items() if int(h["pid"]) in ours})
        log.error("watchdog: %s", verdict.message(self.run_dir))
        if len(self.verdicts) > self.max_restarts:
            self.stop(verdict.message(self.run_dir))
        else:  # let the agent restart the group
            self.kill()

    def result(self, watchdog: Watchdog) -> dict[int, Any]:
        if self.error is None and self.stopped is None and self.outcome is not None:
            return self.outcome
        if self.verdicts:
            attempts = "; ".join(
                f"attempt {i}: {v.message(self.run_dir)}" for i, v in enumerate(self.verdicts)
            )
            raise WorkerError(attempts)
        if self.stopped is not None:
            raise WorkerError(
                f"distributed job {self.run_id} {self.stopped}; every worker was killed"
            )
        err = self.rendezvous_error() or worker_error(self.run_dir, self.error, watchdog)
        if self.rdzv.nnodes > 1 and not isinstance(
            self.error, RendezvousError
        ):  # this node's records only: a victim's error may be all it has
            err = type(err)(
                f"{err} [node-local view of {self.rdzv.nnodes}-node job {self.run_id}: "
                "the root cause may be in another node's run directory]"
            )
        raise err

    def rendezvous_error(self) -> errors.EnnError | None:
        """The nodes did not meet: a peer never came (transient), or the id was used up."""
        if isinstance(self.error, RendezvousClosedError):
            return errors.ConfigError(
                f"runtime.rdzv_id={self.run_id} belongs to a job that already ended at "
                f"{self.endpoint}; pick a new runtime.rdzv_id and pass it to every node"
            )
        if isinstance(self.error, RendezvousError):
            return errors.TransientError(
                f"rendezvous {self.run_id} at {self.endpoint}: {type(self.error).__name__} "
                f"({str(self.error).splitlines()[0] if str(self.error) else 'no detail'}); "
                f"start all {self.rdzv.nnodes} nodes within runtime.rdzv_timeout_s="
                f"{self.rdzv.timeout_s:.0f} with the same runtime.rdzv_endpoint and runtime.rdzv_id"
            )
        return None


class Watchdog:
    """Decides from heartbeats whether a rank is silent, and which one.

    It watches the `nprocs` workers whose heartbeats are in `run_dir`: ranks 0..nprocs-1 on
    one node; on several (`local_only`), this node's share of the global ranks, which the
    rendezvous decides, so a missing rank is named by what this node did see."""

    def __init__(
        self,
        run_dir: Path,
        nprocs: int,
        hang_timeout_s: float,
        budgets: dict[str, float],
        *,
        local_only: bool = False,
        rendezvous_s: float = 0.0,
    ) -> None:
        self.run_dir, self.nprocs = run_dir, nprocs
        self.hang_timeout_s, self.budgets = hang_timeout_s, budgets
        self.local_only, self.rendezvous_s = local_only, rendezvous_s
        self.newest_attempt, self.min_attempt, self.attempt_started = 0, 0, 0.0

    def restarting(self) -> None:
        """The attempt was killed for a hang and the agent restarts the group: the killed
        attempt's heartbeat files stay behind, so from now on only a newer attempt's count,
        and its spawn budget runs from now."""
        self.min_attempt, self.attempt_started = self.newest_attempt + 1, time.time()

    def _current(self, beats: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        if beats:
            self.newest_attempt = max(
                self.newest_attempt, *(int(h.get("attempt", 0)) for h in beats.values())
            )
        return {r: h for r, h in beats.items() if int(h.get("attempt", 0)) >= self.min_attempt}

    def budget(self, phase: str) -> float:
        return self.budgets.get(phase, self.hang_timeout_s)

    def check(self, started: float) -> Verdict | None:
        now = time.time()
        beats = self._current(read_heartbeats(self.run_dir))
        started = max(started, self.attempt_started)
        if len(beats) < self.nprocs:  # still spawning (or waiting for the other nodes)
            if now - started > self.rendezvous_s + self.budget("spawn") + self.hang_timeout_s:
                return self.spawn_verdict(set(beats), now - started)
            return None
        active = {r: h for r, h in beats.items() if h["phase"] != "done"}
        age = {r: now - h["progress_time"] for r, h in active.items()}
        stale = {r for r, h in active.items() if age[r] > self.budget(h["phase"])}
        if not stale:
            return None
        # The culprit is a stale rank outside any collective; a rank inside one is a victim,
        # even when its beating thread stalls (a C++ collective can hold the GIL). A victim
        # goes stale first (it entered the collective before the culprit stopped), so wait
        # for the culprit to go stale too, unless every rank is stale or the wait has lasted
        # a second budget (then: the rank outside a collective, else the oldest).
        silent = sorted(r for r in stale if not active[r].get("in_collective"))
        if silent:
            r = silent[0]
        elif len(stale) == len(active) or any(
            age[k] > 2 * self.budget(active[k]["phase"]) for k in stale
        ):
            outside = [k for k in active if not active[k].get("in_collective")]
            r = max(outside or stale, key=lambda k: age[k])
        else:
            return None
        waiting = sorted(k for k, h in active.items() if h.get("in_collective") and k != r)
        h = beats[r]
        return Verdict(
            r, h["phase"], h.get("step"), now - h["progress_time"], h.get("frame", ""), waiting
        )

    def spawn_verdict(self, seen: set[int], silent_s: float) -> Verdict:
        """The first rank without a heartbeat; on several nodes this node's ranks are known
        only from those that did beat (the rendezvous assigned them), so none may be named."""
        if not self.local_only:
            missing = sorted(set(range(self.nprocs)) - seen)
            return Verdict(missing[0], "spawn", None, silent_s, "never wrote a heartbeat")
        frame = (
            f"{self.nprocs - len(seen)} of this node's {self.nprocs} workers never wrote a "
            f"heartbeat (seen: ranks {sorted(seen)}; no rendezvous yet if none)"
        )
        return Verdict(None, "spawn", None, silent_s, frame)


def dump_stacks(run_dir: Path, beats: dict[int, dict[str, Any]], wait_s: float = 3.0) -> None:
    """SIGUSR1 to every rank (faulthandler writes its stacks), then wait for the files."""
    for h in beats.values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(int(h["pid"]), signal.SIGUSR1)
    end = time.time() + wait_s
    while time.time() < end:
        if all(
            stack_path(run_dir, r).stat().st_size > 0
            for r in beats
            if stack_path(run_dir, r).exists()
        ):
            break
        time.sleep(0.1)


def write_error(
    run_dir: Path, rank: int, err: BaseException, phase: str, step: int | None, tb: str
) -> None:
    """Worker side: the error record the launcher turns into the caller's exception."""
    path = Path(run_dir) / ERRORS / f"rank-{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = {
        "rank": rank,
        "type": type(err).__name__,
        "message": str(err).splitlines()[0] if str(err) else "",
        "phase": phase,
        "step": step,
        "traceback": tb,
        "time": time.time(),
    }
    path.write_text(json.dumps(rec))


def read_errors(run_dir: Path) -> list[dict[str, Any]]:
    recs = []
    for p in sorted((Path(run_dir) / ERRORS).glob("rank-*.json")):
        with contextlib.suppress(OSError, json.JSONDecodeError):
            recs.append(json.loads(p.read_text()))
    return sorted(recs, key=lambda r: r["time"])


_TIMEOUT_HINTS = ("timed out", "timeout", "connection closed by peer", "connection reset")


def worker_error(run_dir: Path, cause: BaseException | None, watchdog: Watchdog) -> errors.EnnError:
    """The caller's exception: the first root-cause rank's error, keeping domain classes.

    A rank whose collective timed out or lost its peer is a victim: if another rank raised,
    that one is named; if another rank went silent, the silent one is named."""
    recs = read_errors(run_dir)
    roots = [r for r in recs if not any(h in r["message"].lower() for h in _TIMEOUT_HINTS)]
    if roots:
        rec = roots[0]
        cls = getattr(errors, rec["type"], None)
        cls = cls if isinstance(cls, type) and issubclass(cls, errors.EnnError) else WorkerError
        step = f" step {rec['step']}" if rec.get("step") is not None else ""
        return cls(
            f"rank {rec['rank']} failed in phase {rec['phase']}{step}: {rec['type']}: "
            f"{rec['message']} (logs in {run_dir / 'logs'})"
        )
    died = _died_without_record(run_dir, cause, {r["rank"] for r in recs})
    if died is not None:
        return WorkerError(died)
    silent = _silent_peer(run_dir, {r["rank"] for r in recs})
    if silent is not None:
        return WorkerError(silent.message(run_dir))
    if recs:
        rec = recs[0]
        return WorkerError(
            f"rank {rec['rank']} failed in phase {rec['phase']}: {rec['type']}: {rec['message']}"
        )
    first = (
        str(cause).strip().splitlines()[0]
        if cause is not None and str(cause).strip()
        else type(cause).__name__
    )
    return WorkerError(f"a worker died without an error record ({first}); see {run_dir / 'logs'}")


def _silent_peer(run_dir: Path, failed: set[int]) -> Verdict | None:
    """After collective timeouts: the rank that raised nothing and was not in a collective."""
    now = time.time()
    beats = read_heartbeats(run_dir)
    waiting = sorted(failed)
    for r, h in sorted(beats.items()):
        if r not in failed and h["phase"] != "done" and not h.get("in_collective"):
            return Verdict(
                r, h["phase"], h.get("step"), now - h["progress_time"], h.get("frame", ""), waiting
            )
    return None


def _died_without_record(
    run_dir: Path, cause: BaseException | None, recorded: set[int]
) -> str | None:
    """A rank that crashed below Python (segfault, abort, kill): name it, its exit and phase."""
    failures = getattr(cause, "failures", None) or {}
    beats = read_heartbeats(run_dir)
    for rank, f in sorted(failures.items()):
        if rank in recorded or rank not in beats:
            continue
        how = f"signal {f.signal_name()}" if f.exitcode < 0 else f"exit code {f.exitcode}"
        h = beats[rank]
        step = f" step {h['step']}" if h.get("step") is not None else ""
        return (
            f"rank {rank} died with {how} in phase {h['phase']}{step} without a Python error "
            f"(a crash below Python); its stderr is under {run_dir / 'logs'}"
        )
    return None
