"""glibc malloc's mmap threshold in a training worker: freed tensors go back to the system.

    set_mmap_threshold(cfg.runtime.malloc_mmap_threshold_mb)  # enn_core.train.worker, first
    trim_heap()   # free heap pages back now (enn_core.runtime.memory, before measuring)

glibc serves an allocation of at least its mmap threshold with a mapping of its own, which
`free` unmaps; anything smaller comes from a heap, whose freed middle stays resident. The
threshold starts at 128 KiB, but glibc raises it to the size of every mapped block it frees,
up to 32 MiB, so after the first step a worker's sharded weights, gradients and optimizer
moments of 4-32 MiB are cut from the heap, and the holes they leave are counted in its peak.
Measured on a 99.2M-parameter model of 8 FSDP2 units at world size 2 (6 steps, two runs
each): a worker's peak 1,240-1,256 MiB with glibc's moving threshold against 1,105-1,108 MiB
with it fixed at 4 MiB, and a step 3.70-3.74 s against 3.83-3.91 s: each mapped block's pages
are faulted in afresh. Past 32 MiB a tensor is mapped either way (504M, 1B: the same seconds).
Fixing the threshold also fixes glibc's trim threshold (128 KiB).

Why 4 MiB by default: below it a small model's many tensors stay on the heap as before (the
demo model's largest tensor is under 1 MiB). `runtime.malloc_mmap_threshold_mb: 0` keeps
glibc's moving threshold. mallopt is glibc's; elsewhere (musl, macOS) this does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from typing import Any

M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def _glibc() -> Any | None:
    """glibc (by its soname: ctypes.util.find_library would run ldconfig in every worker's
    start), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    with contextlib.suppress(OSError):
        return ctypes.CDLL("libc.so.6")
    return None


def set_mmap_threshold(mb: int) -> bool:
    """Fix glibc's mmap threshold at `mb` MiB for this process (0: leave glibc's moving one);
    True when set, False where there is no glibc or nothing to set."""
    libc = _glibc() if mb > 0 else None
    with contextlib.suppress(AttributeError):
        return bool(libc and libc.mallopt(M_MMAP_THRESHOLD, mb << 20))
    return False


def trim_heap() -> None:
    """Hand malloc's free heap memory back to the system (malloc_trim; nothing without glibc)."""
    libc = _glibc()
    with contextlib.suppress(AttributeError):
        if libc:
            libc.malloc_trim(0)
