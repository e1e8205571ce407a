"""The training loop. Reads like a table of contents:

    setup -> for each epoch: train the epoch (named steps), validate, record, early stop?
          -> restore the best epoch's weights -> result

It runs identically in every worker (world size 1 included); everything rank-specific is in
`Runtime` (enn_core.runtime.dist's DistEnv, the wrapped model) and every decision that must
agree across ranks (skip, back off, clip, stop) is agreed by an all-reduce (train/step.py).
Step timings (data wait, compute, optimizer) are buffered and written through the events
log by rank 0 every `log_every` steps and at each epoch end.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from enn_core.config import TrainConfig
from enn_core.events import EventLog
from enn_core.fault import FaultInjector
from enn_core.runtime.dist import DistEnv, agree_any, tighten_timeout
from enn_core.runtime.memory import MemoryGovernor
from enn_core.runtime.sampler import GlobalBlockSampler, make_plan
from enn_core.telemetry import GpuSampler, memory_snapshot, verdict_from_stats, write_epoch
from enn_core.train.evaluate import validate
from enn_core.train.guard import NonFiniteGuard
from enn_core.train.resume import Position, load_weights, resume, save_checkpoint
from enn_core.train.schedule import build_optimizer, build_scheduler
from enn_core.train.step import run_step


@dataclass
class TrainData:
    """Memmaps and split rows (staged row indices)."""

    features: np.ndarray
    labels: np.ndarray
    train_rows: np.ndarray
    val_rows: np.ndarray


@dataclass
class Runtime:
    """What the worker hands the loop: where it runs and with what."""

    env: DistEnv
    model: nn.Module  # wrapped (FSDP2 / DDP / plain)
    core: nn.Module  # the bare model: normalize() / denormalize() (buffers only)
    loss: nn.Module  # per-row loss in normalized units; may own parameters (Student-t scale)
    run_dir: Path
    events: EventLog
    faults: FaultInjector
    heartbeat: Any = None  # enn_core.runtime.heartbeat.Heartbeat
    autocast: Callable[[], AbstractContextManager] = contextlib.nullcontext
    grad_scaler: Any = None  # torch.amp.GradScaler for fp16, from the precision policy
    full_state: Callable[[], dict] | None = None  # gathered state dict (collective under FSDP)
    steady_timeout_s: float | None = None
    micro_batch: int | None = None  # train.micro_batch=auto resolved by the worker's memory probe
    checkpointer: Any = (
        None  # enn_core.train.ckpt.Checkpointer: DCP saves every N steps and epoch end
    )


@dataclass
class TrainResult:
    history: list[dict]
    step_losses: list[float]
    best_epoch: int | None
    stopped_early: bool
    applied_steps: int
    skipped_steps: int
    backoffs: list[dict]
    micro_batch: int
    accumulation: int
    best_val: dict | None = None


@dataclass
class _State:
    cfg: TrainConfig
    data: TrainData
    rt: Runtime
    sampler: GlobalBlockSampler
    governor: MemoryGovernor
    guard: NonFiniteGuard
    optimizer: torch.optim.Optimizer
    scheduler: Any
    log_every: int
    history: list[dict] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)
    pending: list[tuple[str, float, int]] = field(default_factory=list)
    best_loss: float = math.inf
    best_epoch: int | None = None
    best_snapshot: list[torch.Tensor] | None = None
    bad_epochs: int = 0
    applied_steps: int = 0
    epoch_stats: dict = field(default_factory=dict)
    start_gstep: int = 0  # this attempt's first global step (> 0 after a resume)
    gpu: GpuSampler | None = None  # NVML utilization/power/temperature on CUDA (rank 0)

    def __post_init__(self) -> None:
        self.named_params = list(self.rt.model.named_parameters())
        self.model_params = [p for _, p in self.named_params]
        self.loss_params = list(self.rt.loss.parameters())
        self.all_params = self.model_params + self.loss_params
        self.scaler = self.rt.grad_scaler
        if self.rt.env.device.type == "cuda" and self.rt.env.rank == 0:
            self.gpu = GpuSampler(self.rt.env.device)

    def model_train(self) -> None:
        self.rt.model.train()
        self.rt.loss.train()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def back_off(self, epoch: int, gstep: int, reason: str) -> None:
        plan = self.governor.back_off(epoch=epoch, step=gstep, reason=reason)
        self.rt.events.event("oom_backoff", **self.governor.history[-1])
        self.rt.events.metric("memory/micro_batch", plan.micro_batch, gstep)

    def full_state(self) -> dict | None:
        return self.rt.full_state() if self.rt.full_state is not None else None

    def tensors(self) -> list[torch.Tensor]:
        """The optimizer's own parameters (FSDP2's sharded ones: `model.parameters()` returns
        the unsharded ones while a module is unsharded, e.g. the root after an eval forward),
        buffers and the loss's parameters."""
        return [*self.all_params, *self.rt.model.buffers()]


def train(
    cfg: TrainConfig,
    data: TrainData,
    rt: Runtime,
    *,
    seed: int,
    log_every: int = 50,
    resume_from: Path | None = None,
    weights_from: Path | None = None,
) -> TrainResult:
    """Train with early stopping; the model ends holding the best epoch's weights.

    With a checkpointer, the state is saved every `checkpoint.every_steps` steps and at each
    epoch end, and `resume_from` (a committed checkpoint) continues at its exact step;
    `weights_from` (a checkpoint) gives only the starting weights (a warm start)."""
    st = setup(cfg, data, rt, seed=seed, log_every=log_every)
    if weights_from is not None:
        load_weights(st, weights_from)
    start = resume(st, resume_from) if rt.checkpointer is not None else Position(0, 0)
    st.start_gstep = start.epoch * st.sampler.steps_per_epoch + start.step
    stopped = start.stopped
    for epoch in range(start.epoch, cfg.epochs):
        if stopped:
            break
        train_epoch(st, epoch, first_step=start.step if epoch == start.epoch else 0)
        val = validate(st, epoch)
        record_epoch(st, epoch, val)
        stopped = early_stop(st, epoch, val)
        if rt.checkpointer is not None:
            save_checkpoint(
                st, (epoch + 1) * st.sampler.steps_per_epoch, epoch_end=True, stopped=stopped
            )
    restore_best(st)
    return result(st, stopped)


def setup(cfg: TrainConfig, data: TrainData, rt: Runtime, *, seed: int, log_every: int) -> _State:
    sampler = GlobalBlockSampler(
        data.train_rows, cfg.batch_size, seed=seed, shuffle_block=cfg.shuffle_block
    )
    plan = make_plan(
        cfg.batch_size, cfg.micro_batch, rt.env.world_size, auto_micro_batch=rt.micro_batch
    )
    optimizer = build_optimizer([*rt.model.parameters(), *rt.loss.parameters()], cfg)
    scheduler = build_scheduler(optimizer, cfg, total_steps=sampler.steps_per_epoch * cfg.epochs)
    guard = NonFiniteGuard(cfg.max_nonfinite_steps, rt.run_dir / "nonfinite", rank=rt.env.rank)
    governor = MemoryGovernor(plan, cfg.max_oom_backoffs)
    rt.events.param("train/micro_batch", plan.micro_batch)
    rt.events.param("train/accumulation", plan.accumulation)
    rt.events.param("train/steps_per_epoch", sampler.steps_per_epoch)
    rt.events.param("train/total_steps", sampler.steps_per_epoch * cfg.epochs)
    return _State(cfg, data, rt, sampler, governor, guard, optimizer, scheduler, max(1, log_every))


def _fresh_stats() -> dict:
    return {
        "loss": 0.0,
        "weight": 0.0,
        "data_s": 0.0,
        "compute_s": 0.0,
        "optim_s": 0.0,
        "skipped": 0,
    }


def train_epoch(st: _State, epoch: int, first_step: int = 0) -> None:
    """The epoch's steps from `first_step` (> 0 after a mid-epoch resume, whose partial
    statistics the checkpoint restored); timings and losses land in st.history via record_epoch."""
    rt, spe = st.rt, st.sampler.steps_per_epoch
    if st.gpu is not None:
        st.gpu.start()
    if first_step == 0 or not st.epoch_stats:
        st.epoch_stats = _fresh_stats()
    prior_s = st.epoch_stats.pop("wall_s", 0.0)
    every = rt.checkpointer.cfg.every_steps if rt.checkpointer is not None else 0
    st.model_train()
    t0 = time.perf_counter()
    for step in range(first_step, spe):
        gstep = epoch * spe + step
        if rt.heartbeat is not None:
            rt.heartbeat.phase("first_forward" if gstep == st.start_gstep else "step", gstep)
        if rt.faults.cfg.kind != "oom":  # OOM is injected at the step's agreement point (step.py)
            rt.faults.at("step", gstep)
        out = run_step(st, epoch, step, gstep)
        record_step(st, gstep, out)
        if gstep == st.start_gstep and rt.steady_timeout_s:
            tighten_timeout(rt.steady_timeout_s)  # warm-up is over
        if rt.checkpointer is not None:
            rt.checkpointer.poll()  # an async save commits as soon as it is written
        if every and (gstep + 1) % every == 0 and step + 1 < spe:  # the epoch end saves the last
            st.epoch_stats["wall_s"] = prior_s + time.perf_counter() - t0
            save_checkpoint(st, gstep + 1, epoch_end=False)
            st.epoch_stats.pop("wall_s")
    st.epoch_stats["wall_s"] = prior_s + time.perf_counter() - t0


def record_step(st: _State, gstep: int, out) -> None:
    es = st.epoch_stats
    es["data_s"] += out.data_s
    es["compute_s"] += out.compute_s
    es["optim_s"] += out.optim_s
    if out.applied:
        st.applied_steps += 1
        es["loss"] += out.loss * out.weight
        es["weight"] += out.weight
        st.step_losses.append(out.loss)
    else:
        es["skipped"] += 1
    st.pending += [
        ("step/loss", out.loss, gstep),
        ("step/grad_norm", out.grad_norm, gstep),
        ("time/data_wait_s", out.data_s, gstep),
        ("time/compute_s", out.compute_s, gstep),
        ("time/optimizer_s", out.optim_s, gstep),
    ]
    if len(st.pending) >= 5 * st.log_every:
        flush_telemetry(st)


def flush_telemetry(st: _State) -> None:
    for name, value, step in st.pending:
        st.rt.events.metric(name, value, step)
    st.pending.clear()


def record_epoch(st: _State, epoch: int, val: dict | None) -> None:
    es = st.epoch_stats
    # Rows seen this epoch on all ranks: each training row once (padding excluded).
    rows = len(st.data.train_rows)
    row = {
        "epoch": epoch,
        "train_loss": es["loss"] / es["weight"] if es["weight"] else math.nan,
        "lr": float(st.scheduler.get_last_lr()[0]),
        "samples_per_s": rows / es["wall_s"] if es["wall_s"] > 0 else math.nan,
        "data_wait_share": es["data_s"] / es["wall_s"] if es["wall_s"] > 0 else math.nan,
        "skipped_steps": es["skipped"],
        "epoch_s": es["wall_s"],
        "micro_batch": st.governor.plan.micro_batch,
    }
    if val is not None:
        row.update({f"val_{k}": v for k, v in val.items()})
    # Where the epoch's time went: data-, compute-, communication-bound or throttled.
    verdict = verdict_from_stats(es, st.gpu.stop() if st.gpu is not None else None)
    write_epoch(
        st.rt.events,
        epoch,
        verdict,
        {"memory": memory_snapshot(st.rt.env.device), "samples_per_s": row["samples_per_s"]},
    )
    st.history.append({**row, "bottleneck": verdict.bottleneck})
    flush_telemetry(st)
    st.rt.events.metrics(
        {f"epoch/{k}": float(v) for k, v in row.items() if k != "epoch"}, step=epoch
    )


def early_stop(st: _State, epoch: int, val: dict | None) -> bool:
    """Keep the best epoch's weights; stop after `patience` epochs without improvement."""
    if val is None:
        return False
    loss = val["loss"]
    if math.isfinite(loss) and loss < st.best_loss:
        st.best_loss, st.best_epoch, st.bad_epochs = loss, epoch, 0
        st.best_snapshot = [t.detach().clone() for t in st.tensors()]
    else:
        st.bad_epochs += 1
    stop = st.cfg.patience > 0 and st.bad_epochs >= st.cfg.patience
    stop = agree_any(stop, st.rt.env)  # identical inputs on every rank; agreed all the same
    if stop:
        st.rt.events.event(
            "early_stop", epoch=epoch, best_epoch=st.best_epoch, best_val_loss=st.best_loss
        )
    return stop


def restore_best(st: _State) -> None:
    if st.best_snapshot is None:
        return
    with torch.no_grad():
        for t, saved in zip(st.tensors(), st.best_snapshot, strict=True):
            t.copy_(saved)
    st.rt.events.event("restored_best", epoch=st.best_epoch, val_loss=st.best_loss)


def result(st: _State, stopped: bool) -> TrainResult:
    best = next((h for h in st.history if h["epoch"] == st.best_epoch), None)
    return TrainResult(
        history=st.history,
        step_losses=st.step_losses,
        best_epoch=st.best_epoch,
        stopped_early=stopped,
        applied_steps=st.applied_steps,
        skipped_steps=st.guard.total_skipped,
        backoffs=list(st.governor.history),
        micro_batch=st.governor.plan.micro_batch,
        accumulation=st.governor.plan.accumulation,
        best_val=best,
    )
