"""Per-rank heartbeat files and stack dumps: how the launcher tells a hung rank from the peer
that waits for it.

Each worker writes `<run_dir>/heartbeats/rank-<r>.json` (pid, phase, step, progress time,
written atomically). The main thread moves the phase forward (`hb.phase("step", 12)`); a
small thread rewrites the file every `interval` seconds with the main thread's innermost
frame and whether it sits inside torch.distributed (a rank blocked in a collective is a
victim, not the culprit). A rank whose progress time is older than its phase budget while
not inside a collective is the silent one (FIELD_NOTES: nothing in torch sees a hang with
no collective pending; seed 03 is a two-day hunt for exactly that).

`SIGUSR1` makes a worker dump every thread's stack to `<run_dir>/stacks/rank-<r>.txt`
(faulthandler, so it works while the main thread is stuck in C code or a sleep).
A `CANCEL` file in the run directory makes every worker exit at its next beat.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from enn_core.atomic import open_own, process_alive

HEARTBEATS = "heartbeats"
STACKS = "stacks"
CANCEL_FILE = "CANCEL"
_DIST_FRAGMENT = f"torch{os.sep}distributed{os.sep}"
# FSDP2's CPU all-gathers are waited for inside the comm clock (enn_core.runtime.comm_clock's
# timed all-gather calls work.wait() from its own frame): a rank blocked there is in a collective
_CLOCK_FILE = f"enn_core{os.sep}runtime{os.sep}comm_clock.py"


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / HEARTBEATS / f"rank-{rank}.json"


def stack_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / STACKS / f"rank-{rank}.txt"


def _temp_path(path: Path) -> Path:
    """Where `path`'s next version is written before the rename: one per process and thread."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def _write_atomic(path: Path, record: dict[str, Any]) -> None:
    tmp = _temp_path(path)
    with contextlib.suppress(FileNotFoundError):  # a link left there is removed, not followed
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record))
    os.replace(tmp, path)


def stale_temp_files(run_dir: Path) -> list[Path]:
    """This run's heartbeat temp files whose writer is gone: what a write that failed (a full
    disk) leaves before its rename. A file whose process is still alive may be mid-write and
    is left alone."""
    d = Path(run_dir) / HEARTBEATS
    out = []
    for p in sorted(d.glob(".rank-*.json.*.tmp")) if d.is_dir() else []:
        pid = p.name.split(".")[-3]  # .rank-<r>.json.<pid>.<tid>.tmp
        if not (pid.isdigit() and process_alive(int(pid))):
            out.append(p)
    return out


def read_heartbeats(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Every rank's latest heartbeat (a file caught mid-replace is skipped this round)."""
    out: dict[int, dict[str, Any]] = {}
    d = Path(run_dir) / HEARTBEATS
    if not d.is_dir():
        return out
    for p in d.glob("rank-*.json"):
        try:
            rec = json.loads(p.read_text())
            out[int(rec["rank"])] = rec
        except (OSError, ValueError, TypeError, KeyError):  # not one of the workers' records
            continue
    return out


class Heartbeat:
    """The worker side. `phase()` from the main thread; a daemon thread keeps the file fresh."""

    def __init__(
        self, run_dir: str | Path, rank: int, attempt: int = 0, interval: float = 1.0
    ) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.interval = interval
        self.path = heartbeat_path(self.run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._state: dict[str, Any] = {
            "rank": rank,
            "pid": os.getpid(),
            "attempt": attempt,
            "phase": "bootstrap",
            "step": None,
            "progress_time": time.time(),
        }
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # the main thread and the beating thread both write
        self._stop = threading.Event()
        self._main_ident = threading.main_thread().ident
        self._stack_file: TextIO | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        """Register the stack-dump signal and start the beating thread."""
        sp = stack_path(self.run_dir, self.rank)
        sp.parent.mkdir(parents=True, exist_ok=True)
        # kept open for faulthandler; a link planted there is one line, never written through
        stack_file = os.fdopen(open_own(sp, os.O_WRONLY | os.O_TRUNC), "w")
        self._stack_file = stack_file
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
        self._beat()
        self._thread = threading.Thread(target=self._run, name="enn-heartbeat", daemon=True)
        self._thread.start()
        return self

    def phase(self, phase: str, step: int | None = None) -> None:
        """A new phase is written at once; the next step of the same phase is written by the
        beating thread within `interval` (a file write and rename per training step cost
        ~0.5% of a step)."""
        with self._lock:
            changed = phase != self._state["phase"]
            self._state.update(phase=phase, step=step, progress_time=time.time())
        if changed:
            self._beat()

    def progress(self, step: int | None = None) -> None:
        """Progress within the current phase (a long validation, one chunk of a loop)."""
        with self._lock:
            if step is not None:
                self._state["step"] = step
            self._state["progress_time"] = time.time()

    def where(self) -> tuple[str, int | None]:
        """(phase, step) last announced."""
        with self._lock:
            return self._state["phase"], self._state["step"]

    def stop(self, phase: str = "done") -> None:
        self.phase(phase)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval)
        faulthandler.unregister(signal.SIGUSR1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if (self.run_dir / CANCEL_FILE).exists():  # the launcher was cancelled
                os.kill(os.getpid(), signal.SIGKILL)
            self._beat()

    def _beat(self) -> None:
        frame_info = self._main_frame()
        with self._lock:
            rec = dict(self._state, beat_time=time.time(), **frame_info)
        with self._write_lock:
            _write_atomic(self.path, rec)

    def _main_frame(self) -> dict[str, Any]:
        ident = self._main_ident
        frame = sys._current_frames().get(ident) if ident is not None else None
        if frame is None:
            return {"frame": "", "in_collective": False}
        code = frame.f_code
        where = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
        name = code.co_filename
        return {
            "frame": where,
            "in_collective": _DIST_FRAGMENT in name or name.endswith(_CLOCK_FILE),
        }
