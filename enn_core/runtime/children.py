"""The process table: every long-lived child process of enn is started, recorded and stopped
here (docs/design.md, "Who starts and ends what").

    child = children.start("trial", [sys.executable, "-m", ...], log=path, session=True)
    children.running()                 # what runs now: kind, pid, start time, group, log
    children.stop(child)               # stop now: SIGKILL to its tree
    children.stop(child, grace_s=10)   # SIGTERM first (to its group when it leads one)

Starting a child sets up, the same way for each kind:

- the environment: the caller's (else this process's), with the parent-pid handshake
  (ENN_PARENT_PID, enn_core.runtime.parent.spawned_env) for enn's own programs, whose first
  act is `die_with_parent()`;
- the process group: `session=True` gives it a session of its own (a terminal's Ctrl-C, a
  signal to this process's group, does not reach it); else it stays in this one's;
- dying with the parent: enn's own programs by the handshake and their `die_with_parent()`;
  another program (a server: uvicorn, prefect, mlflow) by the kernel's `PR_SET_PDEATHSIG`
  (SIGTERM), set in the child before exec (`foreign=True`);
- the log file: its output and errors appended to `log` (opened with atomic.open_own: no link
  planted there is followed), else nowhere.

A child, and each process of its tree that a stop signals, is recorded by pid and start time
(psutil's create_time), never by command line: a pid the kernel gave to another process after
ours ended is never signalled (`Proc.same`). Stopping goes one way: the signal contract
(SIGTERM, when the child is given a grace to save and leave), then `parent.kill_tree`
(SIGKILL to its descendants, itself and its group). One-shot tools run with `subprocess.run`
(git, dvc, the store migrations) are not long-lived children and are not in the table.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from enn_core.atomic import open_own
from enn_core.runtime.parent import descendants, kill_tree, spawned_env

START_TOLERANCE_S = 0.01  # psutil's create_time of one process, read twice, agrees to this
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Proc:
    """One process, by pid and start time: the pid alone may be another's once it ended."""

    pid: int
    started: float

    @classmethod
    def of(cls, pid: int) -> Proc | None:
        """The process `pid` now (None: there is none, or it is not ours to read)."""
        import psutil  # here: `enn` imports the launcher at start

        try:
            return cls(pid, psutil.Process(pid).create_time())
        except psutil.Error:
            return None

    def same(self) -> bool:
        """Whether this process still exists (a zombie not yet reaped included): its pid is
        held by a process started at the recorded time."""
        now = Proc.of(self.pid)
        return now is not None and abs(now.started - self.started) <= START_TOLERANCE_S


@dataclass
class Child:
    """A child process of the table: its Popen (pipes, exit code) and its record."""

    kind: str  # what it is: torchrun, worker, trial, prefect-api, server
    proc: subprocess.Popen[bytes]
    record: Proc
    group: bool  # it leads a process group (a session) of its own
    log: Path | None

    @property
    def pid(self) -> int:
        return self.proc.pid


_table: dict[int, Child] = {}
_lock = threading.Lock()


def term_when_parent_dies() -> None:
    """In a foreign child before exec (Linux): SIGTERM when the thread that started it dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start(  # noqa: PLR0913  what a child is started with, each a keyword
    kind: str,
    command: list[str],
    *,
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
    session: bool = False,
    foreign: bool = False,
    cwd: Path | str | None = None,
) -> Child:
    """`command` started as a child of kind `kind` and recorded (module docstring): `log`
    gets its output and errors."""
    base = dict(os.environ if env is None else env)
    env_ = base if foreign else spawned_env(base)
    preexec = term_when_parent_dies if foreign else None
    out: int | IO[Any] = subprocess.DEVNULL
    with contextlib.ExitStack() as stack:
        if log is not None:
            out = stack.enter_context(os.fdopen(open_own(log), "ab"))
        proc = subprocess.Popen(
            command,
            env=env_,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if log is not None else subprocess.DEVNULL,
            start_new_session=session,
            preexec_fn=preexec,  # noqa: PLW1509 - only prctl, before exec
        )
    record = Proc.of(proc.pid) or Proc(proc.pid, 0.0)  # 0.0: it ended already
    child = Child(kind, proc, record, session, log)
    running()  # ended children leave the table
    with _lock:
        _table[proc.pid] = child
    return child


def running() -> list[Child]:
    """The children that run now, in the order they started (ended ones leave the table)."""
    with _lock:
        kids = list(_table.values())
    ended = [c for c in kids if c.proc.poll() is not None]
    with _lock:
        for c in ended:
            if _table.get(c.pid) is c:
                del _table[c.pid]
    return [c for c in kids if c not in ended]


def tree(child: Child) -> set[Proc]:
    """The processes `child` started, and theirs, recorded now (none once it is reaped: its
    pid may be another's then)."""
    if child.proc.returncode is not None:
        return set()
    found = (Proc.of(pid) for pid in descendants(child.pid))
    return {p for p in found if p is not None}


def kill(procs: Iterable[Proc]) -> set[int]:
    """SIGKILL to each of `procs` that is still the process recorded; their pids."""
    killed = set()
    for p in procs:
        if p.same():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, signal.SIGKILL)
                killed.add(p.pid)
    return killed


def terminate(child: Child, grace_s: float, to_group: bool | None = None) -> bool:
    """The signal contract's first half: SIGTERM to `child` (to its group when it leads one,
    or as `to_group` says) and up to `grace_s` for it to end; whether it ended."""
    if child.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if child.group if to_group is None else to_group:
                os.killpg(child.pid, signal.SIGTERM)
            else:
                child.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(grace_s)
    return child.proc.poll() is not None


def stop(child: Child, grace_s: float = 0.0, also: Iterable[Proc] = ()) -> list[int]:
    """Stop `child`, the one way: with `grace_s`, `terminate` first; then `kill_tree` to its
    descendants (and `also`: processes the caller recorded, e.g. workers) that are still the
    processes recorded, to it, and to its group while the group is its own (its leader not
    reaped, or no process holding its pid now: a group's id is not given to a new process
    while a member lives). Reaped, out of the table; the pids killed."""
    child.proc.poll()  # an ended leader reaped now: its pid is not taken for a live one below
    procs = {*tree(child), *also}  # before the grace: a leader gone by then leaves its tree
    if grace_s > 0:
        terminate(child, grace_s)
        procs |= tree(child)
    live = {p for p in procs if p.same()}
    alive = child.proc.returncode is None
    group = child.group and (alive or Proc.of(child.pid) is None)
    kill_tree(child.proc, {p.pid for p in live}, group=group)
    with _lock:
        if _table.get(child.pid) is child:
            del _table[child.pid]
    return sorted({p.pid for p in live} | ({child.pid} if alive else set()))
