"""SIGTERM ends a worker within seconds, even while its main thread waits in C++.

A Python signal handler runs only when the main thread returns to the interpreter: a rank
blocked in a TCPStore wait or a gloo collective (waiting for a peer that never came) runs
none, and ignored the launcher's SIGTERM until its timeout (minutes). Python's C-level
handler still writes the signal's number to the wakeup file descriptor from whatever thread
it interrupts, so a helper thread reading that descriptor sees the SIGTERM at once: it gives
the main thread `grace_s` to stop the Python way (its handler, cleanup, exit code), then ends
the process with one line and exit code 143.

    watch_sigterm(rank=env.rank)   # in the worker's main thread, after its handlers are set

A main thread that took the signal itself to end the process its own way (a preemption save,
enn_core.train.preempt: a step, then a checkpoint that may take minutes for a large model)
says so with `owned()`: the helper then leaves the process to it (before, it ended every
rank 5 s after SIGTERM, in the middle of that save). The hang watchdog and the scheduler's
SIGKILL still bound a save that never ends.

Nothing is installed when SIGTERM has no Python handler (the default action already ends the
process) or when someone else owns the wakeup descriptor (an asyncio loop).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

GRACE_S = 5.0
EXIT = 128 + signal.SIGTERM
_OWNED = threading.Event()  # the main thread took the signal and ends the process itself


def owned() -> None:
    """The main thread saw the stop and ends the process itself: the helper leaves it."""
    _OWNED.set()


def watch_sigterm(rank: int, grace_s: float = GRACE_S) -> bool:
    """Start the helper thread; returns whether it was installed (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if not callable(signal.getsignal(signal.SIGTERM)):
        return False
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:
        os.close(r)
        os.close(w)
        return False
    if previous != -1:  # someone else's (an event loop): leave it theirs
        signal.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)
        return False
    threading.Thread(
        target=_watch, args=(r, rank, grace_s), name="enn-sigterm", daemon=True
    ).start()
    return True


def _watch(fd: int, rank: int, grace_s: float) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGTERM in data:
            break
    done = threading.Event()
    done.wait(grace_s)  # the main thread's own handler may still end the process cleanly
    if _OWNED.is_set():  # it ran and is saving (preemption): its end, not ours
        return
    with contextlib.suppress(OSError):
        sys.stderr.write(
            f"rank {rank}: SIGTERM while waiting in a collective or the store: stopped\n"
        )
        sys.stderr.flush()
    os._exit(EXIT)
