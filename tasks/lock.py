"""One pipeline run per work directory at a time.

An advisory `flock` on `work/pipeline.lock`, taken by `enn run`, by each `enn <stage>`
(so `dvc repro` stages too) and by the Prefect flows. Re-entrant within one process (the
flow takes it, then runs stages in-process). The second run gets a clear message naming the
holder instead of interleaving with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from enn_core.atomic import open_own
from enn_core.errors import LockError

_held: dict[str, tuple[int, int]] = {}  # path -> (fd, depth)
_mutex = threading.Lock()


@contextlib.contextmanager
def pipeline_lock(path: Path, what: str) -> Iterator[None]:
    key = str(path)
    with _mutex:
        if key in _held:
            fd, depth = _held[key]
            _held[key] = (fd, depth + 1)
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield
        finally:
            _leave(key)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = open_own(path, os.O_RDWR, 0o644)  # never through a link: it is truncated below
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = Path(path).read_text(errors="replace").strip() or "{}"
        os.close(fd)
        try:
            info = json.loads(holder)
        except json.JSONDecodeError:
            info = {}
        raise LockError(
            f"{path}: another pipeline run holds this work directory "
            f"(pid {info.get('pid', '?')}, '{info.get('what', '?')}', "
            f"since {info.get('since', '?')}); "
            "wait for it to finish or stop it, then re-run"
        ) from None
    os.ftruncate(fd, 0)
    os.write(
        fd,
        json.dumps(
            {
                "pid": os.getpid(),
                "what": what,
                "argv": sys.argv[:4],
                "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
        ).encode(),
    )
    with _mutex:
        _held[key] = (fd, 1)
    try:
        yield
    finally:
        _leave(key)


def _leave(key: str) -> None:
    """One holder leaves; the last one, whichever it is, releases the lock. Holders in other
    threads (Prefect runs tasks in threads; a batch job's sessions overlap) may leave after the
    one that took it: it must not release the lock under them."""
    with _mutex:
        fd, depth = _held[key]
        if depth > 1:
            _held[key] = (fd, depth - 1)
            return
        del _held[key]
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
