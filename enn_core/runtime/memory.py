"""Memory: the out-of-memory back-off, and measuring peak memory for the auto micro-batch.

Back-off: halve the micro-batch, double accumulation, retry the step.

The effective (global) batch never changes, so a backed-off step computes the same update
as the step without back-off up to summation order. Every back-off is recorded; after
`max_backoffs` (or when the micro-batch is already 1) training stops with an error that
says what to change. The decision is agreed across ranks by an all-reduce so every rank
runs the retried step with the same plan (FSDP needs every rank in every collective).

Measuring (`measure_peak`, `memory_budget`; enn_core.runtime.batch_probe uses them): on CUDA
the allocator's own peak counter; on CPU the growth of the process's resident anonymous memory
(VmHWM reset through /proc/self/clear_refs, file-page growth subtracted, the free malloc heap
released first so reused memory cannot hide the need).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
import torch

from enn_core.errors import OutOfMemory, oom_held
from enn_core.runtime.malloc import trim_heap
from enn_core.runtime.sampler import Plan


def is_oom(err: BaseException) -> bool:
    """A real or injected out-of-memory error: torch's OutOfMemoryError (CUDA), torch's CPU
    allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory"), numpy's
    MemoryError, an OSError ENOMEM (`enn_core.errors.oom_held` reads them)."""
    return (
        isinstance(err, torch.OutOfMemoryError)
        or oom_held(type(err).__name__, str(err)) is not None
    )


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (the micro-batches a per-rank batch of n can be cut into)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def halved(plan: Plan) -> Plan:
    """Half the micro-batch, same global batch. An odd micro-batch (train.micro_batch=auto can
    pick one, e.g. 3 of 24) steps to the largest divisor of the per-rank batch at most half."""
    if plan.micro_batch % 2 == 0:
        return plan.halved()
    m = max(d for d in divisors(plan.per_rank) if d <= plan.micro_batch // 2)
    return Plan(global_batch=plan.global_batch, world_size=plan.world_size, micro_batch=m)


@dataclass
class MemoryGovernor:
    """The current micro-batch plan and the record of every back-off."""

    plan: Plan
    max_backoffs: int
    history: list[dict[str, int | str]] = field(default_factory=list)

    def back_off(self, *, epoch: int, step: int, reason: str) -> Plan:
        """Halve the micro-batch (same global batch); OutOfMemory when no room is left
        (`reason`: the out-of-memory error's message)."""
        old = self.plan
        if len(self.history) >= self.max_backoffs or old.micro_batch <= 1:
            held = oom_held("MemoryError", reason)  # reason: the error's message
            tried = f" (it tried to allocate {held})" if held else ""
            raise OutOfMemory(
                f"out of memory at epoch {epoch} step {step} with micro_batch={old.micro_batch}"
                f"{tried} after {len(self.history)} back-offs "
                f"(limit train.max_oom_backoffs={self.max_backoffs}); "
                f"lower train.batch_size or set train.micro_batch to a smaller divisor of the "
                f"per-rank batch {old.per_rank}, or use train.precision=bf16"
            )
        self.plan = halved(old)
        self.history.append(
            {
                "epoch": epoch,
                "step": step,
                "micro_batch_before": old.micro_batch,
                "micro_batch_after": self.plan.micro_batch,
                "accumulation_after": self.plan.accumulation,
                "reason": reason[:200],
            }
        )
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return self.plan


# --- Measuring the peak memory of one piece of work (used by enn_core.runtime.batch_probe) ---

MIB = 2**20


def _proc_status_kb(*names: str) -> dict[str, int]:
    """Fields of /proc/self/status in kB (Linux); missing fields read as -1."""
    out = dict.fromkeys(names, -1)
    with contextlib.suppress(OSError), open("/proc/self/status") as f:  # no /proc: all stay -1
        for line in f:
            key, _, rest = line.partition(":")
            if key in out:
                out[key] = int(rest.split()[0])
    return out


def anon_bytes() -> int:
    """This process's resident anonymous memory (RssAnon), in bytes; 0 where /proc has none."""
    return max(0, _proc_status_kb("RssAnon")["RssAnon"]) * 1024


def _reset_host_peak() -> bool:
    """Reset VmHWM to the current RSS (writing 5 to /proc/self/clear_refs, Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _release_free_heap() -> None:
    """Hand free malloc memory back to the OS, so that the next piece of work has to grow the
    RSS to get its memory (otherwise a retained heap hides the need). No gc.collect here: it
    takes ~0.7 s in a big process and tensors are freed by reference counting; callers that
    may hold cyclic garbage collect once before measuring."""
    trim_heap()


def release_free_heap() -> None:
    """Hand free malloc memory back to the OS after a phase that freed much (a worker's
    training state before rank 0 gathers the full weights): tensors freed inside malloc's heap
    (under glibc's own mmap threshold, runtime.malloc_mmap_threshold_mb=0, which FSDP2's
    gathers raise to 32 MB, shards and moments live there)
    stay resident, as RssAnon, until trimmed."""
    _release_free_heap()


@dataclass(frozen=True)
class PeakReading:
    """The peak memory of one call: `bytes` is what the budget is compared with."""

    bytes: int
    how: str  # what was measured, for the reason string


def host_peak(fn: Callable[[], object]) -> PeakReading:
    """Peak growth of this process's resident memory while `fn()` runs (CPU work).

    VmHWM is reset to the current RSS first, so `VmHWM - RSS before` is the growth `fn` caused.
    VmHWM counts file pages as well as anonymous memory (FIELD_NOTES: memmap reads inflate RSS),
    so growth of RssFile during the call is subtracted: what remains is anonymous memory,
    provided the file pages mapped at the peak are still mapped at the end (true of a training
    step over its memmaps; not of work that maps files and drops them, such as stage-data:
    measure that with `sampled_anon_peak`).
    """
    _release_free_heap()
    if sys.platform.startswith("linux") and _reset_host_peak():
        before = _proc_status_kb("VmRSS", "RssFile")
        fn()
        after = _proc_status_kb("VmHWM", "RssFile")
        file_growth = max(0, after["RssFile"] - before["RssFile"])
        grown = max(0, after["VmHWM"] - before["VmRSS"] - file_growth)
        return PeakReading(grown * 1024, "peak growth of resident anonymous memory (VmHWM)")
    return sampled_anon_peak(fn)


def sampled_anon_peak(fn: Callable[[], object]) -> PeakReading:
    """Sample RssAnon every millisecond during `fn()`: anonymous memory only, whatever files
    `fn` maps and unmaps (host_peak's fallback where VmHWM cannot be reset)."""
    base = _proc_status_kb("RssAnon")["RssAnon"]
    if base < 0:
        rss = psutil.Process().memory_info().rss
        fn()
        grown = psutil.Process().memory_info().rss - rss
        return PeakReading(max(0, grown), "RSS growth after the call (no /proc: a lower bound)")
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak[0] = max(peak[0], _proc_status_kb("RssAnon")["RssAnon"])

    t = threading.Thread(target=sample, name="enn-anon-sampler", daemon=True)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    peak[0] = max(peak[0], _proc_status_kb("RssAnon")["RssAnon"])
    return PeakReading((peak[0] - base) * 1024, "peak growth of RssAnon sampled every 1 ms")


def cuda_peak(fn: Callable[[], object], device: torch.device) -> PeakReading:
    """Peak memory allocated on `device` while `fn()` runs, everything already held included
    (parameters, gradients): the absolute figure the device budget is compared with."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return PeakReading(
        int(torch.cuda.max_memory_allocated(device)),
        "torch.cuda.max_memory_allocated (parameters and gradients included)",
    )


def measure_peak(fn: Callable[[], object], device: torch.device | str) -> PeakReading:
    """`cuda_peak` on a CUDA device, `host_peak` otherwise."""
    device = torch.device(device)
    return cuda_peak(fn, device) if device.type == "cuda" else host_peak(fn)


def memory_budget(
    device: torch.device | str, headroom: float, local_world_size: int = 1
) -> tuple[int, str]:
    """(bytes one rank may use, how that was derived), keeping `headroom` of memory free.

    CUDA: (1 - headroom) x (free + what this process's allocator already reserved) on the
    rank's device (other processes' use excluded), within any per-process fraction cap.
    CPU: (1 - headroom) x MemAvailable shared by the ranks of this host; measured growth is
    compared with it (the process already holds the rest)."""
    device = torch.device(device)
    keep = 1.0 - headroom
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        usable = free + torch.cuda.memory_reserved(device)
        cap = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if cap is not None:  # a set_per_process_memory_fraction cap is a hard allocator limit
            usable = min(usable, int(cap(device) * total))
        how = (
            f"{keep:.0%} of {usable / MIB:.0f} MiB usable on {torch.cuda.get_device_name(device)} "
            f"(free {free / MIB:.0f} + reserved by this process, of {total / MIB:.0f} MiB total)"
        )
        return int(keep * usable), how
    avail = psutil.virtual_memory().available
    ranks = max(1, local_world_size)
    per = "" if ranks == 1 else f" / {ranks} local ranks"
    return int(keep * avail / ranks), f"{keep:.0%} of MemAvailable {avail / MIB:.0f} MiB{per}"
