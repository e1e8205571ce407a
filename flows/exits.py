"""How an `enn` process ends: SIGTERM taken as Ctrl-C, and the exit of a stopped command.

SIGTERM takes Ctrl-C's path (`Terminated` is a KeyboardInterrupt): the lock released, MLflow
runs closed, Prefect's temporary server stopped. Without this, Prefect's flow engine re-sends
SIGTERM to the default handler, and the process dies mid-cleanup. The one difference from
Ctrl-C (docs/design.md, the launch spine's signal contract): a job this process launched is
told to save at the next step boundary and leave within torchrun's shutdown timeout, where
Ctrl-C and a cancel stop it at once.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import NoReturn

from enn_core.runtime.parent import exit_process, request_graceful_stop


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: everything that cleans up after Ctrl-C runs."""


_terminating = threading.Event()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if _terminating.is_set():  # a second SIGTERM must not cut the cleanup short (SIGKILL forces)
        print("SIGTERM again: still stopping workers and releasing the lock", file=sys.stderr)
        return
    _terminating.set()
    request_graceful_stop()  # a running launch forwards it: the workers save, then leave
    raise Terminated()


def terminating() -> bool:
    """Whether this process got SIGTERM (its stop may reach the caller as a plain interrupt)."""
    return _terminating.is_set()


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


def exit_with(code: int) -> NoReturn:
    """End this process with `code` (the entry point's: in-process callers of `main` keep
    theirs): `exit_process`, streams flushed, no long finalization."""
    exit_process(code)
