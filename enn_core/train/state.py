"""The training state: one typed object that the loop builds once and its steps work on.

    st = TrainState(cfg, data, rt, sampler, governor, guard, optimizer, scheduler, ...)
    run_step(st, epoch, step, gstep)          # enn_core.train.step
    validate(st, epoch)                       # enn_core.train.evaluate
    save_checkpoint(st, ...); resume(st, p)   # enn_core.train.resume

`TrainState` is frozen: what the loop is made of (config, data, runtime, sampler, optimizer,
scheduler, guard, memory governor, the module DCP saves, the parameter groups) is fixed for
the run. What the loop advances lives in its one mutable field, `progress` (`Progress`: the
loss curve, history, early stopping, the current epoch's `EpochStats`), which is what
`trainer.json` saves and `resume` restores. `Runtime` is what the worker hands the loop.

This module imports nothing of the loop's steps; step, resume, evaluate and loop import it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from enn_core.config import TrainConfig
from enn_core.events import EventLog
from enn_core.fault import FaultInjector
from enn_core.metric_names import telemetry
from enn_core.model.enn import ENN
from enn_core.runtime.comm_clock import CommClock
from enn_core.runtime.dist import DistEnv
from enn_core.runtime.heartbeat import Heartbeat
from enn_core.runtime.memory import MemoryGovernor
from enn_core.runtime.sampler import GlobalBlockSampler
from enn_core.telemetry import GpuSampler
from enn_core.train.ckpt import Checkpointer
from enn_core.train.guard import NonFiniteGuard
from enn_core.train.preempt import PreemptWatch


@dataclass(frozen=True)
class TrainData:
    """Memmaps and split rows (staged row indices)."""

    features: np.ndarray
    labels: np.ndarray
    train_rows: np.ndarray
    val_rows: np.ndarray


@dataclass(frozen=True)
class Runtime:
    """What the worker hands the loop: where it runs and with what."""

    env: DistEnv
    model: nn.Module  # wrapped (FSDP2 / DDP / plain)
    core: ENN  # the bare model: normalize() / denormalize() (buffers only)
    loss: nn.Module  # per-row loss in normalized units; may own parameters (Student-t scale)
    run_dir: Path
    events: EventLog
    faults: FaultInjector
    heartbeat: Heartbeat | None = None
    autocast: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
    grad_scaler: torch.amp.GradScaler | None = None  # fp16 only, from the precision policy
    full_state: Callable[[], dict[str, torch.Tensor]] | None = None  # collective under FSDP
    steady_timeout_s: float | None = None
    micro_batch: int | None = None  # train.micro_batch=auto resolved by the worker's memory probe
    checkpointer: Checkpointer | None = None  # DCP saves every N steps and at epoch ends
    preempt: PreemptWatch | None = None  # SIGTERM/SIGUSR2 seen: save and stop (train/preempt.py)
    # Time blocked in collectives: FSDP2's own (enn_core.runtime.comm_clock) and the loop's.
    comm: CommClock = field(default_factory=CommClock)


@dataclass(frozen=True)
class TrainResult:
    history: list[dict[str, Any]]
    step_losses: list[float]
    best_epoch: int | None
    stopped_early: bool
    applied_steps: int
    skipped_steps: int
    backoffs: list[dict[str, Any]]
    micro_batch: int
    accumulation: int
    best_val: dict[str, Any] | None = None


@dataclass
class EpochStats:
    """Sums over the current epoch's steps. Seconds are exclusive: communication (`comm_s`)
    is taken out of the data, compute and optimizer phases it happened in; `ckpt_s` is the
    time saving checkpoints since the previous epoch's record (its epoch-end save included)."""

    loss: float = 0.0  # weighted loss sum of the applied steps
    weight: float = 0.0
    data_s: float = 0.0
    compute_s: float = 0.0
    optim_s: float = 0.0
    comm_s: float = 0.0
    ckpt_s: float = 0.0
    skipped: int = 0
    wall_s: float = 0.0  # the epoch's steps, from its first step (a resumed epoch's included)

    def as_record(self) -> dict[str, float]:
        """`trainer.json`'s "epoch_stats" (a mid-epoch checkpoint) and the verdict's input."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> EpochStats:
        """Keys missing in a checkpoint written before they existed (comm_s, ckpt_s) are 0."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})


@dataclass
class Progress:
    """What the loop advances, and what a checkpoint saves and a resume restores."""

    history: list[dict[str, Any]] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)
    pending: list[tuple[str, float, int]] = field(default_factory=list)  # unflushed metrics
    best_loss: float = math.inf
    best_epoch: int | None = None
    best_held: bool = False  # the live weights are the best epoch's (trained no further)
    best_path: Path | None = None  # where else they are: a checkpoint or a file (best.py)
    bad_epochs: int = 0
    applied_steps: int = 0
    epoch: EpochStats | None = None  # None: no partial epoch to continue
    start_gstep: int = 0  # this attempt's first global step (> 0 after a resume)
    ckpt_carry_s: float = 0.0  # an epoch-end save's seconds, counted in the next epoch


@dataclass(frozen=True)
class Params:
    """The optimizer's parameters, grouped as the step needs them. FSDP2's sharded ones:
    `model.parameters()` returns the unsharded ones while a module is unsharded (e.g. the
    root after an eval forward), so these lists are taken once, before any forward."""

    named: list[tuple[str, nn.Parameter]]  # the model's, for naming a non-finite gradient
    model: list[nn.Parameter]
    loss: list[nn.Parameter]  # replicated (Student-t scale): their grads are all-reduced

    @classmethod
    def of(cls, model: nn.Module, loss: nn.Module) -> Params:
        named = list(model.named_parameters())
        return cls(named, [p for _, p in named], list(loss.parameters()))

    @property
    def all(self) -> list[nn.Parameter]:
        return self.model + self.loss


@dataclass(frozen=True)
class TrainState:
    """The loop's state: built once by enn_core.train.loop.setup, advanced in `progress`."""

    cfg: TrainConfig
    data: TrainData
    rt: Runtime
    sampler: GlobalBlockSampler
    governor: MemoryGovernor
    guard: NonFiniteGuard
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    holder: nn.ModuleDict  # {"model", "loss"}: the module DCP saves (the optimizer spans both)
    params: Params
    log_every: int
    total_steps: int  # the run's optimizer steps: train.epochs of them, capped by max_steps
    eval_batch: int  # rows per validation forward (train.eval_batch, auto resolved)
    gpu: GpuSampler | None = None  # NVML utilization/power/temperature on CUDA (rank 0)
    progress: Progress = field(default_factory=Progress)

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.rt.grad_scaler

    def epoch_end(self, epoch: int) -> int:
        """The global position after `epoch`'s last step (train.max_steps may cut it short)."""
        return min((epoch + 1) * self.sampler.steps_per_epoch, self.total_steps)

    @property
    def epoch_stats(self) -> EpochStats:
        """The current epoch's sums (train_epoch starts them)."""
        if self.progress.epoch is None:
            raise RuntimeError("no epoch in progress: train_epoch starts one")
        return self.progress.epoch

    def model_train(self) -> None:
        self.rt.model.train()
        self.rt.loss.train()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def back_off(self, epoch: int, gstep: int, reason: str) -> None:
        plan = self.governor.back_off(epoch=epoch, step=gstep, reason=reason)
        self.rt.events.event("oom_backoff", **self.governor.history[-1])
        self.rt.events.metric(telemetry("memory/micro_batch"), plan.micro_batch, gstep)

    def full_state(self) -> dict[str, torch.Tensor] | None:
        return self.rt.full_state() if self.rt.full_state is not None else None

    def tensors(self) -> list[torch.Tensor]:
        """What early stopping snapshots and restores: the optimizer's own parameters (see
        Params), the model's buffers and the loss's parameters."""
        return [*self.params.all, *self.rt.model.buffers()]


def holder_of(rt: Runtime) -> nn.ModuleDict:
    """One module over the model and the loss: DCP's state keys are "model.*" and "loss.*"."""
    return nn.ModuleDict({"model": rt.model, "loss": rt.loss})
