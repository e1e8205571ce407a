"""A worker's anonymous memory, watched: its peak per phase, and a per-process limit.

`AnonWatch` samples this process's resident anonymous memory (RssAnon, as
enn_core.runtime.memory measures it: a mapped checkpoint's or memmap's file pages do not count,
they are the page cache's and any process mapping the file shares them) every `every_s` in a
daemon thread, and keeps the peak of each phase the worker's heartbeat names. With a limit
(`runtime.worker_memory_limit_mb`), a sample above it ends the process at once: the error
record names what it held, the limit and what to change, and the launcher turns it into the
stage's one out-of-memory line (exit code 13), as it does a worker's MemoryError.

Why not `RLIMIT_DATA` or `RLIMIT_AS`: the kernel counts virtual sizes there, not memory held.
A checkpoint read with `mmap=True` is a private writable mapping of the whole file, every
thread's stack (8 MiB each, torch and gloo start dozens) and each malloc arena's reserve count
too, so a limit set from a measured peak would refuse a worker that holds far less. The limit
here is the figure docs/benchmarks.md and the bench report; the price is that it is checked,
not enforced by the kernel: a process can pass it by what it allocates between two samples.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from enn_core.errors import OutOfMemory
from enn_core.runtime.memory import anon_bytes

MIB = 2**20


def over_limit(held: int, limit_mb: int) -> OutOfMemory:
    """The one line of a worker that held `held` bytes past `runtime.worker_memory_limit_mb`."""
    return OutOfMemory(
        f"out of memory: the worker held {held / MIB:.0f} MiB of anonymous memory, over "
        f"runtime.worker_memory_limit_mb={limit_mb}; train on more workers (a larger "
        "runtime.world_size: FSDP2 shards the weights, gradients and optimizer state across "
        "them) or with a smaller train.micro_batch, or raise the limit"
    )


class AnonWatch:
    """The peak RssAnon of each phase (`where()` -> (phase, step), the heartbeat's); above
    `limit_mb` (0: no limit), `on_over(error, phase, step)` is called once from the watching
    thread (it writes the error record and ends the process)."""

    def __init__(
        self,
        where: Callable[[], tuple[str, int | None]],
        limit_mb: int = 0,
        on_over: Callable[[OutOfMemory, str, int | None], None] | None = None,
        every_s: float = 0.01,
    ) -> None:
        self.where, self.limit_mb, self.on_over, self.every_s = where, limit_mb, on_over, every_s
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="enn-anon-watch", daemon=True)

    def start(self) -> AnonWatch:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.sample()

    def peaks_mib(self) -> dict[str, float]:
        """{phase: its peak in MiB}, in the order the phases came."""
        return {phase: round(b / MIB, 1) for phase, b in self.peaks.items()}

    def sample(self) -> int:
        held = anon_bytes()
        phase, step = self.where()
        self.peaks[phase] = max(self.peaks.get(phase, 0), held)
        if self.limit_mb and held > self.limit_mb * MIB and self.on_over is not None:
            on_over, self.on_over = self.on_over, None  # once
            on_over(over_limit(held, self.limit_mb), phase, step)
        return held

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()


def end_process(code: int = 1) -> None:
    """End this process now, from any thread (the main one may be inside a C++ operator)."""
    os._exit(code)
