"""How long this rank is blocked in collectives: FSDP2's own and the loop's.

    clock = CommClock()
    time_fsdp_collectives(model, clock)          # after fully_shard (enn_core.runtime.dist)
    with clock:                                  # around a collective the loop issues itself
        all_reduce_sum(stats, env)
    clock.seconds                                # monotonic: callers read differences

FSDP2 runs its all-gathers (forward, and backward for resharded blocks) and reduce-scatters
(backward) inside `model(x)` and `loss.backward()`, where the loop cannot see them. torch
2.13's `FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter` take the object FSDP2
calls for each of them (its `AllGather` / `ReduceScatter` interface); `time_fsdp_collectives`
gives every FSDP2 module one that wraps torch's default (same buffers, same
`all_gather_single` / `reduce_scatter_single` calls: the numbers do not change) between two
`perf_counter` reads. The time counted is the time the call blocks: the transfer plus the
wait for the slowest peer, which is what a rank loses to communication.

What it does not see: under HSDP, the all-reduce across replicas that FSDP2 issues itself
with `dist.all_reduce` (no hook in 2.13); DDP's bucketed all-reduce (asynchronous, inside
autograd). On the CPU the blocks unshard with async_op=True (enn_core.runtime.dist, for
memory): the timed all-gather waits for its Work inside the clock, so the time counted is the
same blocking time. On
CUDA the calls only enqueue work on NCCL streams, so the time is launch time; the GPU verdict
rests on NVML there (enn_core.telemetry).

Cost: two clock reads and an addition per collective (a gloo collective takes tens of
microseconds at the least). `delays` adds a sleep inside the timed call: the collective-delay
fault (enn_core.fault, `fault.kind=comm_delay`) that tests use to make a run
communication-bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

# The interfaces set_custom_all_gather / set_custom_reduce_scatter take, and torch's defaults,
# live in private modules in torch 2.13 (the public FSDPModule methods name them).
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)

COLLECTIVES = ("all_gather", "reduce_scatter")


class CommClock:
    """Seconds this process spent inside timed collectives, and how many there were.

    As a context manager it times the block it wraps (one block at a time: not reentrant;
    FSDP2's collectives are added by the hooks, not by a `with`)."""

    __slots__ = ("seconds", "calls", "_t0")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._t0 = 0.0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.calls += 1

    def __enter__(self) -> CommClock:
        self._t0 = time.perf_counter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.add(time.perf_counter() - self._t0)


def _timed(
    clock: CommClock, delay_s: float, call: Callable[..., dist.Work | None], *args: Any
) -> dist.Work | None:
    """`call(*args)` with the time it blocks (and an injected delay) added to `clock`."""
    t0 = time.perf_counter()
    try:
        if delay_s:
            time.sleep(delay_s)
        return call(*args)
    finally:
        clock.add(time.perf_counter() - t0)


class _TimedAllGather(AllGather):
    def __init__(self, clock: CommClock, delay_s: float = 0.0) -> None:
        self.clock, self.delay_s, self.inner = clock, delay_s, DefaultAllGather()

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        return _timed(
            self.clock, self.delay_s, self._gather, output_tensor, input_tensor, group, async_op
        )

    def _gather(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool,
    ) -> dist.Work | None:
        work = self.inner(output_tensor, input_tensor, group, async_op)
        if async_op and work is not None:
            # On the CPU the blocks unshard with async_op=True (enn_core.runtime.dist): wait
            # here, inside the clock, so the time counted is still the time the rank is
            # blocked; FSDP2's own wait() on the finished Work returns at once.
            work.wait()
        return work


class _TimedReduceScatter(ReduceScatter):
    def __init__(self, clock: CommClock, delay_s: float = 0.0) -> None:
        self.clock, self.delay_s, self.inner = clock, delay_s, DefaultReduceScatter()

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        work = _timed(
            self.clock, self.delay_s, self.inner, output_tensor, input_tensor, group, op, async_op
        )
        if not async_op and input_tensor.device.type == "cpu":
            # Done: the unit's gradients were reduced into output_tensor. FSDP2 keeps this
            # input (a whole unit's gradients) until the next unit's reduce-scatter, so that
            # a CUDA allocator does not reuse it while a stream may still read it; a CPU
            # collective that returned has read it, and keeping it only raises every
            # backward's peak by one unit. Free its memory now (the tensor stays, empty).
            input_tensor.untyped_storage().resize_(0)
        return work


def time_fsdp_collectives(
    model: nn.Module, clock: CommClock, delays: Mapping[str, float] | None = None
) -> int:
    """Route the all-gathers and reduce-scatters of every FSDP2 module in `model` through
    `clock`; `delays` ({"all_gather": s, "reduce_scatter": s}) sleeps inside each one.
    Returns the number of FSDP2 modules (0 for a plain or DDP model: nothing to time)."""
    delays = delays or {}
    unknown = set(delays) - set(COLLECTIVES)
    if unknown:
        raise ValueError(f"unknown collectives {sorted(unknown)}; expected {COLLECTIVES}")
    n = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(_TimedAllGather(clock, delays.get("all_gather", 0.0)))
            module.set_custom_reduce_scatter(
                _TimedReduceScatter(clock, delays.get("reduce_scatter", 0.0))
            )
            n += 1
    return n
