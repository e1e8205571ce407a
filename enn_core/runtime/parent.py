"""Process lifetimes of a job, without torch (the `enn` command imports this at start):

    die_with_parent()          # first thing in every process a job starts
    request_graceful_stop()    # the enn process got a scheduler's warning (SIGTERM)
    exit_process(code)         # the last thing: the code, without the interpreter's long goodbye
    kill_tree(proc, pids, group)  # stop now: a launch's torchrun and workers, a tuning trial

Dying with the parent: the one copy, used by every process a job starts (the torchrun child
of enn, each worker it starts, a training worker under an external launcher).

Linux asks the kernel for SIGKILL when the parent dies (`PR_SET_PDEATHSIG`); a thread also
watches the parent's pid, for the case the kernel's signal does not cover (the parent thread
that started this process ended while the parent lives on, another OS).

A parent that died before the call (Python's start and imports take seconds, and a study or
an `enn` killed in that window is the common case, not a corner) ends this process at once.
The process cannot learn who its parent was once it has been handed to init, so the parent
says it: `spawned_env(env)` puts its pid in ENN_PARENT_PID for the child it starts, and the
child's `die_with_parent()` takes it out again (a one-hop message, never inherited by a
grandchild). Without it (a worker under an external torchrun), the parent is whoever it is
at the call. An environment variable, not a setting: it is how a process speaks to its
child across exec, set and read only here.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, NoReturn

_PR_SET_PDEATHSIG = 1
PARENT_ENV = "ENN_PARENT_PID"
_watching: list[int] = []
_graceful = threading.Event()


def request_graceful_stop() -> None:
    """A scheduler's warning reached this process (SIGTERM: flows/exits.py calls this before
    raising): a launch it interrupts forwards the signal to its workers and gives them
    torchrun's shutdown timeout to save at a step boundary and leave, instead of killing
    them at once (Ctrl-C, a cancel)."""
    _graceful.set()


def graceful_stop_requested() -> bool:
    return _graceful.is_set()


def clear_graceful_stop() -> None:
    _graceful.clear()


def spawned_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a child this process starts whose first act is `die_with_parent()`."""
    return {**env, PARENT_ENV: str(os.getpid())}


def _named_parent() -> int | None:
    said = os.environ.pop(PARENT_ENV, "")
    return int(said) if said.isdigit() and int(said) > 1 else None


def die_with_parent(poll_s: float = 0.5) -> None:
    """SIGKILL this process when its parent dies; idempotent."""
    parent = _named_parent() or os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os._exit(1)
    if _watching:
        return
    _watching.append(parent)

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="enn-parent-watch", daemon=True).start()


def exit_process(code: int) -> NoReturn:
    """End this process with `code`, the streams flushed, after freezing the objects alive now
    out of the garbage collector. The interpreter's finalization otherwise traverses every one
    of them (torch, Prefect, MLflow, DVC: millions) in its last collections: 2 to 3 s of a
    two-core machine after an `enn run` printed its summary (py-spy: gc_collect_main), paid
    again by each worker. The exit hooks still run (Prefect's last logs and events, a temporary
    API's stop, logging's flush); only cycles alive at exit are left to the kernel."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    gc.freeze()
    sys.exit(code)


def descendants(pid: int) -> set[int]:
    """The processes `pid` started, and theirs (none once it is gone)."""
    import psutil  # here: `enn` imports this module at start

    with contextlib.suppress(psutil.Error):
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    return set()


def kill_tree(proc: subprocess.Popen[Any], pids: set[int], group: bool) -> None:
    """Stop now: SIGKILL to `pids` (what `proc` started: workers, a trial's torchrun), to `proc`
    and, with `group`, to the process group it leads (`start_new_session`: anything else it
    started there); `proc` reaped, then the rest waited for. The one way a job's processes are
    killed, reached through the process table (enn_core.runtime.children.stop)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    if group:  # a group outlives its leader while a member lives: its id is theirs
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    until_ended(pids)


def until_ended(pids: set[int], timeout_s: float = 5.0) -> None:
    """Until every process of `pids` has ended (gone, or a zombie its reaper has not collected):
    SIGKILL is delivered at once, but a worker with a large address space takes a moment to
    end, and the stage's error must not come while one still runs (CI saw one, once)."""
    deadline = time.monotonic() + timeout_s
    while pids and time.monotonic() < deadline:
        pids = {pid for pid in pids if _running(pid)}
        if pids:
            time.sleep(0.05)


def _running(pid: int) -> bool:
    import psutil

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False
