"""The watchdog of a launched job, in the process that started it: heartbeats, phase budgets,
stacks on SIGUSR1, and the one error a failed job becomes.

- `Watchdog.check` reads each rank's heartbeat (enn_core.runtime.heartbeat) and, when a rank is
  silent past its phase budget, returns a `Verdict` naming that rank and its last phase, not
  the peer waiting for it in a collective; `dump_stacks` has every rank write its stack to
  `<run_dir>/stacks/` (faulthandler on SIGUSR1) before the launcher kills the attempt.
- A worker that raises writes `<run_dir>/errors/rank-<r>.json` (`write_error`);
  `worker_error` turns the records, each rank's exit (code or signal, from the launcher's
  record) and the heartbeats into the caller's exception: the first root-cause rank's error,
  keeping domain classes so retry rules still apply. Out of memory is OutOfMemory: a rank's
  MemoryError or allocator error, or a rank killed by SIGKILL (most likely the kernel's
  out-of-memory killer: nothing in the job sends it unasked).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from enn_core import errors
from enn_core.atomic import write_json
from enn_core.errors import OutOfMemory, WorkerError, oom_held
from enn_core.runtime.heartbeat import read_heartbeats, stack_path

ERRORS = "errors"

# Phases with their own budget (seconds) instead of hang_timeout: slow by nature.
DEFAULT_BUDGETS = {"spawn": 90.0, "compile": 300.0, "checkpoint": 300.0}
FIRST_FORWARD = "first_forward"  # the heartbeat phase of an attempt's first training step


def first_forward_budget(
    hang_timeout_s: float, model_bytes: int, s_per_gb: float
) -> tuple[float, str]:
    """(seconds, why): the budget of an attempt's first training step, which gathers every
    weight for the first time (FSDP2's first all-gathers: seed 03's hang), allocates the
    optimizer's state and warms the kernels, all in one heartbeat phase: `hang_timeout_s` plus
    `s_per_gb` (runtime.first_forward_s_per_gb) per GB of the model's weights, so that a
    large model's first step is not called hung while a real hang is still named, with its
    phase, once that budget has passed."""
    gb = model_bytes / 1e9
    extra = gb * s_per_gb
    why = (
        f"runtime.hang_timeout_s={hang_timeout_s:g} + {gb:.2f} GB of weights x "
        f"runtime.first_forward_s_per_gb={s_per_gb:g}"
    )
    return hang_timeout_s + extra, why


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
    write_json(path, rec)  # replaced, never written through a link planted there


def read_errors(run_dir: Path) -> list[dict[str, Any]]:
    recs = []
    for p in sorted((Path(run_dir) / ERRORS).glob("rank-*.json")):
        with contextlib.suppress(OSError, json.JSONDecodeError):
            rec = json.loads(p.read_text())
            if well_formed(rec):
                recs.append(rec)
    return sorted(recs, key=lambda r: r["time"])


def well_formed(rec: Any) -> bool:
    """An error record as `write_error` writes it (anything else in the folder is skipped)."""
    want: dict[str, type | tuple[type, ...]] = {
        "rank": int,
        "type": str,
        "message": str,
        "time": (int, float),
    }
    return isinstance(rec, dict) and all(isinstance(rec.get(k), t) for k, t in want.items())


# victims: a collective that timed out, lost its peer, or (predict's barrier) saw it go away
_TIMEOUT_HINTS = (
    "timed out",
    "timeout",
    "connection closed by peer",
    "connection reset",
    "went away",
)


def worker_error(
    run_dir: Path,
    cause: str | None,
    watchdog: Watchdog | None,
    exits: dict[int, int] | None = None,
) -> errors.EnnError:
    """The caller's exception: the first root-cause rank's error, keeping domain classes.

    A rank whose collective timed out or lost its peer is a victim: if another rank raised,
    that one is named; if another rank went silent, the silent one is named. `exits`: each
    failed rank's exit code (negative: the signal), as the launcher recorded them; `cause`:
    the launcher's own one line when no rank says more."""
    recs = read_errors(run_dir)
    roots = [r for r in recs if not any(h in r["message"].lower() for h in _TIMEOUT_HINTS)]
    if roots:
        rec = roots[0]
        step = f" step {rec['step']}" if rec.get("step") is not None else ""
        held = oom_held(rec["type"], rec["message"]) if rec["type"] != "OutOfMemory" else None
        if held is not None:  # numpy's MemoryError, torch's allocators: the stage names a fix
            what = f"tried to allocate {held}" if held else rec["message"]
            return OutOfMemory(
                f"rank {rec['rank']} ran out of memory in phase {rec['phase']}{step}: {what} "
                f"({rec['type']}; logs in {run_dir / 'logs'})"
            )
        cls = getattr(errors, rec["type"], None)
        cls = cls if isinstance(cls, type) and issubclass(cls, errors.EnnError) else WorkerError
        return cls(
            f"rank {rec['rank']} failed in phase {rec['phase']}{step}: {rec['type']}: "
            f"{rec['message']} (logs in {run_dir / 'logs'})"
        )
    died = _died_without_record(run_dir, exits or {}, {r["rank"] for r in recs})
    if died is not None:
        return died
    silent = _silent_peer(run_dir, {r["rank"] for r in recs})
    if silent is not None:
        return WorkerError(silent.message(run_dir))
    if recs:
        rec = recs[0]
        return WorkerError(
            f"rank {rec['rank']} failed in phase {rec['phase']}: {rec['type']}: {rec['message']}"
        )
    first = cause or "no detail"
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


def exit_name(code: int) -> str:
    """`signal SIGKILL` for a negative exit code, `exit code N` otherwise."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _died_without_record(
    run_dir: Path, exits: dict[int, int], recorded: set[int]
) -> errors.EnnError | None:
    """A rank that crashed below Python (segfault, abort, kill): name it, its exit and phase.
    SIGKILL, which nothing in the job sends unasked (the launcher's own kills of a hung or
    cancelled job are said before this), is most likely the kernel's out-of-memory killer."""
    beats = read_heartbeats(run_dir)
    # torchrun ends the survivors of a failed rank with SIGTERM: they come last
    for rank, code in sorted(exits.items(), key=lambda rc: (rc[1] == -signal.SIGTERM, rc[0])):
        if rank in recorded:
            continue
        h = beats.get(rank)
        where = ""
        if h is not None:
            step = f" step {h['step']}" if h.get("step") is not None else ""
            where = f" in phase {h['phase']}{step}"
        if killed(code):
            return OutOfMemory(killed_line(f"rank {rank}", code, where, run_dir / "logs"))
        if h is None:
            continue
        return WorkerError(
            f"rank {rank} died with {exit_name(code)}{where} without a Python error "
            f"(a crash below Python); its stderr is under {run_dir / 'logs'}"
        )
    return None


def killed(code: int) -> bool:
    """An exit by SIGKILL: -9 as a parent sees it, 137 as a shell or container reports it."""
    return code in (-signal.SIGKILL, 128 + signal.SIGKILL)


def killed_line(who: str, code: int, where: str, logs: Path) -> str:
    """The one line of a process killed by SIGKILL (`where`: " in phase step step 3" or "")."""
    how = "exit 137, " if code > 0 else ""
    return (
        f"{who} was killed by signal 9 (SIGKILL, {how}no Python error){where}, most likely by "
        "the kernel's out-of-memory killer (`dmesg` or `journalctl -k` shows 'Out of memory: "
        f"Killed process'); its output is under {logs}"
    )
