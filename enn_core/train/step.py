"""One optimizer step: read the micro-batches, forward/backward each, agree across ranks,
then skip (non-finite), back off (out of memory) or clip and apply.

The loss of a global batch is the weighted sum of per-row losses over its real rows divided
by their count, so the update does not depend on how the batch is cut (ranks, micro-batches,
back-offs). Each rank scales its backward by `world_size / n_real` because FSDP2 and DDP
average gradients across ranks.

Everything that must agree across ranks travels in one float64 all-reduce per step:
[loss sum, weight sum, sharded grad sum of squares, non-finite flag, preemption flag]. The clip
norm, the skip decision, the reported loss and the decision to stop for preemption
(enn_core.train.preempt) are therefore identical on every rank by construction.

Timing: the step's phases (data, forward/backward, optimizer) are wall-clock intervals, and
`rt.comm` counts the seconds spent inside collectives in each: FSDP2's all-gathers and
reduce-scatters in forward/backward (enn_core.runtime.comm_clock) and the step's own
all-reduces. A phase's reported time excludes its communication, reported apart.
"""

from __future__ import annotations

import contextlib
import math
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from enn_core.runtime.dist import agree_any, all_reduce_sum, gather_objects
from enn_core.runtime.memory import is_oom
from enn_core.runtime.sampler import Batch, micro_batches
from enn_core.train.guard import first_nonfinite
from enn_core.train.objective import weighted_loss_sum
from enn_core.train.state import TrainState


@dataclass(frozen=True)
class StepOutcome:
    applied: bool
    loss: float
    weight: float
    grad_norm: float
    data_s: float  # reading the batch (and agreeing on an out-of-memory back-off)
    compute_s: float  # forward + backward, FSDP2's collectives in them excluded
    optim_s: float  # agreement, clipping, the optimizer step, its all-reduce excluded
    comm_s: float  # inside collectives during the step (the three phases' sum)
    preempt: bool = False  # some rank was asked to stop (SIGTERM/SIGUSR2): all ranks agreed


def run_step(st: TrainState, epoch: int, step: int, gstep: int) -> StepOutcome:
    """One optimizer step with OOM back-off (retries the same global batch)."""
    rt, comm = st.rt, st.rt.comm
    while True:
        t0, c0 = time.perf_counter(), comm.seconds
        rows, weights = st.sampler.step_rows(epoch, step, rt.env.rank, rt.env.world_size)
        n_real = st.sampler.real_rows(epoch, step)
        batches = micro_batches(
            st.data.features, st.data.labels, rows, weights, st.governor.plan.micro_batch
        )
        if rt.faults.wants_nan("step", gstep):  # poison this rank's first row: a bad staged row
            batches[0].features[0, 0] = np.nan
        oom = rt.faults.wants_oom("step", gstep)
        with collectives(st):
            any_oom = agree_any(oom, rt.env)
        t1, c1 = time.perf_counter(), comm.seconds
        if any_oom:  # every rank backs off together, before any collective
            st.back_off(
                epoch, gstep, "injected out-of-memory" if oom else "out-of-memory on a peer rank"
            )
            continue
        try:
            loss_sum, weight_sum = forward_backward(st, batches, n_real, gstep)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if (
                not is_oom(e) or rt.env.distributed
            ):  # mid-collective OOM cannot be agreed: fail loudly
                raise
            st.zero_grad()
            st.back_off(epoch, gstep, str(e))
            continue
        t2, c2 = time.perf_counter(), comm.seconds
        applied, loss, norm, preempt = finish_step(st, batches, loss_sum, weight_sum, epoch, gstep)
        t3, c3 = time.perf_counter(), comm.seconds
        return StepOutcome(
            applied,
            loss,
            weight_sum,
            norm,
            data_s=(t1 - t0) - (c1 - c0),
            compute_s=(t2 - t1) - (c2 - c1),
            optim_s=(t3 - t2) - (c3 - c2),
            comm_s=c3 - c0,
            preempt=preempt,
        )


def collectives(st: TrainState) -> AbstractContextManager[object]:
    """Times the step's own collectives on `rt.comm`; at world size 1 there are none (the
    agreement helpers return at once), and nothing is counted."""
    return st.rt.comm if st.rt.env.distributed else contextlib.nullcontext()


def forward_backward(
    st: TrainState, batches: list[Batch], n_real: int, gstep: int
) -> tuple[torch.Tensor, float]:
    """Accumulate gradients over this rank's micro-batches; returns (weighted loss sum, weights)."""
    rt = st.rt
    dev = rt.env.device
    scale = rt.env.world_size / max(n_real, 1)
    loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
    weight_sum = 0.0
    for i, b in enumerate(batches):
        x = torch.from_numpy(b.features).to(dev, non_blocking=True)
        y = torch.from_numpy(b.labels).to(dev, non_blocking=True)
        if gstep == 0 and i == 0:
            rt.faults.at("first_forward", 0)
        with rt.autocast():
            pred = rt.model(x)
        weighted = weighted_loss_sum(rt.loss, pred.float(), rt.core.normalize(y), b.weights)
        backward(st, weighted * scale)
        loss_sum += weighted.detach().double()
        weight_sum += b.n_real
    return loss_sum, weight_sum


def backward(st: TrainState, loss: torch.Tensor) -> None:
    """Backward, through the fp16 gradient scaler when the precision policy uses one."""
    if st.scaler is not None:
        st.scaler.scale(loss).backward()
    else:
        loss.backward()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def grad_squares(st: TrainState) -> tuple[float, float]:
    """(sum of squares of sharded local grads, of replicated grads); the first is all-reduced."""
    sharded = [
        _local(p.grad)
        for p in st.params.model
        if p.grad is not None and hasattr(p.grad, "to_local")
    ]
    replicated = [
        p.grad for p in st.params.all if p.grad is not None and not hasattr(p.grad, "to_local")
    ]

    def sq(ts: list[torch.Tensor]) -> float:
        if not ts:
            return 0.0
        return float(torch.stack(torch._foreach_norm(ts)).double().pow(2).sum())

    return sq(sharded), sq(replicated)


def finish_step(
    st: TrainState,
    batches: list[Batch],
    loss_sum: torch.Tensor,
    weight_sum: float,
    epoch: int,
    gstep: int,
) -> tuple[bool, float, float, bool]:
    """Agree, then skip a non-finite step or clip and apply. Returns (applied, loss, grad norm,
    whether any rank asked to stop for preemption)."""
    rt = st.rt
    if st.scaler is not None:
        st.scaler.unscale_(st.optimizer)
    sharded_sq, replicated_sq = grad_squares(st)
    local_loss = float(loss_sum)
    local_bad = not math.isfinite(local_loss) or not math.isfinite(sharded_sq + replicated_sq)
    asked = rt.preempt is not None and rt.preempt.requested
    mine = [local_loss, weight_sum, sharded_sq, 1.0 if local_bad else 0.0, float(asked)]
    loss_total, weights, sharded_total, bad, asked_any = agree_sums(st, mine)
    loss = loss_total / max(weights, 1.0)
    preempt = asked_any > 0
    # Under HSDP each shard lives on `replicas` ranks: the all-reduced sum counts it that often.
    sharded_total /= rt.env.replicas
    norm = math.sqrt(sharded_total + replicated_sq) if math.isfinite(sharded_total) else math.inf
    if bad > 0 or not math.isfinite(loss) or not math.isfinite(norm):
        if st.scaler is not None and math.isfinite(loss):  # fp16 overflow: the scaler's job
            st.scaler.update(new_scale=st.scaler.get_scale() * st.scaler.get_backoff_factor())
            rt.events.event("fp16_overflow_skip", step=gstep, new_scale=st.scaler.get_scale())
            st.zero_grad()
            return False, loss, norm, preempt
        skip_nonfinite(st, batches, epoch, gstep, local_bad)
        return False, loss, norm, preempt
    clip = st.cfg.clip_norm
    if clip > 0 and norm > clip:  # exactly untouched when the threshold is not reached
        grads = [_local(p.grad) for p in st.params.all if p.grad is not None]
        torch._foreach_mul_(grads, clip / (norm + 1e-6))
    if st.scaler is not None:
        st.scaler.step(st.optimizer)
        st.scaler.update()
    else:
        st.optimizer.step()
    st.scheduler.step()
    st.zero_grad()
    st.guard.record_ok()
    return True, loss, norm, preempt


def agree_sums(st: TrainState, mine: list[float]) -> list[float]:
    """The step's numbers summed over the ranks in one float64 all-reduce (and the loss's own
    gradients averaged); at world size 1 they are this rank's, with no tensor made."""
    if not st.rt.env.distributed:
        return mine
    stats = torch.tensor(mine, dtype=torch.float64)
    with collectives(st):
        all_reduce_sum(stats, st.rt.env)
        reduce_loss_grads(st)
    return stats.tolist()


def reduce_loss_grads(st: TrainState) -> None:
    """The loss's own parameters (Student-t scale) are replicated: average their grads."""
    if not st.rt.env.distributed:
        return
    for p in st.params.loss:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(st.rt.env.world_size)


def skip_nonfinite(
    st: TrainState, batches: list[Batch], epoch: int, gstep: int, local_bad: bool
) -> None:
    """Count the skip (agreed); stop after N in a row naming the first non-finite tensor."""
    rt = st.rt
    culprit = None
    if local_bad:
        named: list[tuple[str, torch.Tensor | None]] = [
            (f"batch.features[micro {i}]", torch.from_numpy(b.features))
            for i, b in enumerate(batches)
        ]
        named += [
            (f"batch.labels[micro {i}]", torch.from_numpy(b.labels)) for i, b in enumerate(batches)
        ]
        named += [(f"grad.{n}", p.grad) for n, p in st.params.named]
        culprit = first_nonfinite(named)
    reports = gather_objects(culprit, rt.env)
    bad_rank = next((r for r, c in enumerate(reports) if c is not None), None)
    name = reports[bad_rank] if bad_rank is not None else None
    stop = st.guard.record_skip(epoch=epoch, step=gstep, culprit=name, culprit_rank=bad_rank)
    rt.events.event(
        "nonfinite_skip",
        epoch=epoch,
        step=gstep,
        tensor=name,
        rank=bad_rank,
        consecutive=st.guard.consecutive,
    )
    st.zero_grad()
    if st.guard.consecutive == 1:  # the first bad step of a run: save it for replay (all ranks)
        st.guard.save_batch(gstep, batches, st.full_state())
    if stop:
        first = st.guard.first_event_of_run()
        rank = first["rank"] if first["rank"] is not None else 0
        raise st.guard.stop_error(st.guard.dump_dir / f"rank-{rank}-step-{first['step']}.pt")
