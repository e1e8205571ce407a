"""How an `enn` process ends: SIGTERM taken as Ctrl-C, and the exit of a stopped command.

SIGTERM takes Ctrl-C's path (`Terminated` is a KeyboardInterrupt): workers are killed, the
lock released, MLflow runs closed, Prefect's temporary server stopped. Without this, Prefect's
flow engine re-sends SIGTERM to the default handler, and the process dies mid-cleanup.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: everything that cleans up after Ctrl-C runs."""


_terminating = threading.Event()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if _terminating.is_set():  # a second SIGTERM must not cut the cleanup short (SIGKILL forces)
        print("SIGTERM again: still stopping workers and releasing the lock", file=sys.stderr)
        return
    _terminating.set()
    raise Terminated()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While the block runs (main thread only), SIGTERM raises `Terminated` like Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _terminating.clear()
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def ended_by(e: BaseException) -> str:
    """The stopped stage's status in the summary."""
    if isinstance(e, Terminated):
        return "terminated"
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    return "failed"


def wait_for_agents(timeout_s: float = 60.0) -> None:
    """Let stopped elastic agents (enn_core.runtime.launch's daemon threads "enn-agent-*")
    finish shutting down before the interpreter exits: a daemon thread still inside torch's
    C++ code at interpreter finalization is torn down there, which aborts the process
    ("terminate called without an active exception"). One SIGTERMed `enn run` under heavy
    load printed that at exit (1 of ~15); launch() waits only 10 s for its agent."""
    end = time.monotonic() + timeout_s
    for t in threading.enumerate():
        if t.name.startswith("enn-agent-") and t.is_alive():
            t.join(max(0.0, end - time.monotonic()))


STOPPED = (130, 143)  # interrupted or cancelled, terminated


def exit_with(code: int) -> None:
    """End this process with `code`: a stopped command through `end_stopped`, any other as
    Python ends. Only for a process's entry point: in-process callers of `main` keep theirs."""
    if code in STOPPED:
        end_stopped(code)
    sys.exit(code)


def end_stopped(code: int) -> None:
    """End a stopped command without the interpreter's finalization. Everything of ours is
    done by then (workers stopped, lock released, MLflow runs ended, the last line printed),
    but a thread of torch's elastic agent or store that a stop cut short can still be inside
    C++ when finalization tears the interpreter down, which aborts the process: "terminate
    called without an active exception", SIGABRT (exit -6) instead of 143 (1 of ~15 SIGTERMed
    runs under load, even after `wait_for_agents`). So: what Python's exit runs first, in its
    order (threading's exit hooks, where Prefect sends its last logs, and the join of
    non-daemon threads; then atexit's: servers stopped, logs flushed), then `os._exit`."""
    with contextlib.suppress(Exception):
        getattr(threading, "_shutdown")()  # noqa: B009 - CPython's own first step at exit
    with contextlib.suppress(Exception):
        import atexit

        getattr(atexit, "_run_exitfuncs")()  # noqa: B009 - runs each hook once, then clears
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
