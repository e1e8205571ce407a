"""`train.micro_batch: auto`: the largest micro-batch that fits in memory, with the reason.

    sample = sample_from_staged(data.features, data.labels, data.split("train"), env.device,
                                core.normalize)
    choice = choose_micro_batch(wrapped, loss, sample, cfg.train.batch_size // env.world_size,
                                env.device, headroom=cfg.train.memory_headroom,
                                autocast=precision.autocast, distributed=env.distributed)
    choice = agree_choice(choice, env)            # every rank: the MIN over ranks
    plan = make_plan(cfg.train.batch_size, cfg.train.micro_batch, env.world_size,
                     auto_micro_batch=choice.micro_batch)

Decisions and why:
- `auto` applies to the micro-batch (rows per forward/backward per rank), never to the global
  batch `train.batch_size`: the global batch is an optimization hyperparameter (it sets the
  gradient noise, the number of optimizer steps and the schedule), so choosing it from the
  memory of the machine would make the result depend on the hardware. The micro-batch only
  trades memory for accumulation steps: the update is the same (enn_core.train.step divides the
  weighted loss sum by the global batch's real rows, however the batch is cut).
- Candidates are the divisors of the per-rank batch (the sampler cuts each rank's slice into
  equal micro-batches), largest first.
- Two ways to find the largest that fits; both measure the step's own work: a forward under the
  precision policy's autocast, the per-row loss in fp32, the backward (as enn_core.train.step).
  `trial` (CUDA at world size 1): run each candidate from the largest down; an out-of-memory
  error or a peak over the budget moves to the next. Exact, and an OOM is harmless in one
  process. Not used with several ranks: an OOM on one rank in the middle of an FSDP collective
  leaves the others waiting in it (the step's back-off refuses the same case for that reason).
  `fit` (CPU, and CUDA with several ranks): measure the peak at two small sizes (after one
  warm-up), fit peak = fixed + bytes_per_row x rows and take the largest divisor whose
  prediction fits. Small sizes do not run out of memory, and every rank runs the same sizes, so
  the collectives inside the probe's forwards/backwards line up.
- What the probe cannot see is added: AdamW's two moment buffers per parameter (the optimizer
  does not exist yet; its step's temporaries come when the activations are already freed) and,
  on CPU, the host copy of the whole per-rank slice that the sampler reads in one gather.
- Budget: (1 - train.memory_headroom) of the free device memory on CUDA; of MemAvailable shared
  by the local ranks on CPU (see enn_core.runtime.memory.memory_budget).
- Nothing the training sees changes: gradients are restored (None before the first step), the
  buffers and the CPU/CUDA RNG states are restored (dropout draws in the probe would otherwise
  shift the run's random stream), and the model's train/eval mode is left as it was. The
  optimizer is built after the probe. A run with `auto` is therefore bit-identical to a run
  with the chosen integer set explicitly.
- Ranks measure different figures (allocator noise, other processes), so the choice is agreed
  with an all-reduce MIN (`agree_choice`); MIN of divisors of the same number is a divisor.
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from enn_core.errors import OutOfMemory, TrainingError
from enn_core.runtime.memory import (
    MIB,
    PeakReading,
    divisors,
    is_oom,
    measure_peak,
    memory_budget,
)

if TYPE_CHECKING:
    from enn_core.runtime.dist import DistEnv

SampleFn = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
AutocastFn = Callable[[], contextlib.AbstractContextManager[Any]]


class _Trial(TypedDict, total=False):
    """One candidate of the trial method: out of memory (`result`), or its measured peak."""

    micro_batch: int
    result: str
    peak_bytes: int
    need_bytes: int


@dataclass(frozen=True)
class MicroBatchChoice:
    """The decision, why, and the figures it rests on."""

    micro_batch: int
    reason: str
    measured: dict[str, Any] = field(default_factory=dict)  # JSON-able figures

    def as_record(self) -> dict[str, int | str]:
        return {
            "micro_batch": self.micro_batch,
            "micro_batch_reason": self.reason,
            "micro_batch_measured": json.dumps(self.measured, sort_keys=True, default=str),
        }


def sample_from_staged(
    features: np.ndarray,
    labels: np.ndarray,
    rows: np.ndarray,
    device: torch.device | str,
    normalize: Callable[[torch.Tensor], torch.Tensor],
) -> SampleFn:
    """sample(n) -> (features, normalized labels) of n real training rows on `device` (the
    first rows, repeated when there are fewer than n): what a step feeds the model and loss."""
    rows = np.sort(np.asarray(rows, dtype=np.int64))
    if len(rows) == 0:
        raise TrainingError(
            "train.micro_batch=auto needs training rows; the training split is empty"
        )

    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pick = np.resize(rows, n)
        x = torch.from_numpy(np.asarray(features[pick], dtype=np.float32)).to(device)
        y = torch.from_numpy(np.asarray(labels[pick], dtype=np.float32)).to(device)
        return x, normalize(y)

    return sample


def choose_micro_batch(  # noqa: PLR0913  the trainer's and tests' keyword API, kept as it is
    model: nn.Module,
    loss_fn: nn.Module,
    sample: SampleFn,
    per_rank_batch: int,
    device: torch.device | str,
    *,
    headroom: float = 0.2,
    autocast: AutocastFn = contextlib.nullcontext,
    distributed: bool = False,
    local_world_size: int = 1,
    method: Literal["auto", "trial", "fit"] = "auto",
    budget_bytes: int | None = None,
    probe_rows: int = 64,
) -> MicroBatchChoice:
    """The largest divisor of `per_rank_batch` whose forward+backward fits the memory budget.

    `model` is the wrapped model (run after wrap, before the optimizer exists); `sample(n)`
    gives n rows on the device; `budget_bytes` replaces the budget derived from the device.
    `method="auto"` is `trial` on CUDA at world size 1, `fit` otherwise (module docstring).
    """
    device = torch.device(device)
    if per_rank_batch < 1:
        raise TrainingError(f"train.micro_batch=auto: per-rank batch {per_rank_batch} must be >= 1")
    if per_rank_batch == 1:
        return MicroBatchChoice(1, "auto: the per-rank batch is 1 row", {"per_rank": 1})
    if method == "auto":
        method = "trial" if device.type == "cuda" and not distributed else "fit"
    if method == "trial" and distributed:  # an OOM on one rank mid-collective hangs the others
        raise TrainingError(
            "choose_micro_batch: method='trial' is for one process; use 'fit' with ranks"
        )
    if budget_bytes is None:
        budget, budget_how = memory_budget(device, headroom, local_world_size)
    else:
        budget, budget_how = int(budget_bytes), "given budget"
    probe = _Probe(model, loss_fn, sample, device, autocast)
    extra, extra_how = _unseen_bytes(probe, per_rank_batch, device)
    facts: dict[str, Any] = {
        "method": method,
        "per_rank": per_rank_batch,
        "budget_bytes": budget,
        "budget": budget_how,
        "unseen_bytes": extra,
        "unseen": extra_how,
    }
    gc.collect()  # once: cyclic garbage freed now is not mistaken for the step's need
    with probe.preserved():
        if method == "trial":
            return _by_trial(probe, per_rank_batch, budget, extra, facts)
        return _by_fit(probe, per_rank_batch, budget, extra, facts, probe_rows)


class _Probe:
    """One forward+backward of n rows, measured, as enn_core.train.step runs it."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: nn.Module,
        sample: SampleFn,
        device: torch.device,
        autocast: AutocastFn,
    ) -> None:
        self.model, self.loss_fn, self.sample = model, loss_fn, sample
        self.device, self.autocast = device, autocast
        self.params = [*model.parameters(), *loss_fn.parameters()]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with self.autocast():
            pred = self.model(x)
        # the step's weighted loss sum: the per-row loss (fp32) times the real rows
        (self.loss_fn(pred.float(), y) * x.shape[0]).backward()

    def peak(self, n: int) -> PeakReading:
        x, y = self.sample(n)  # before the measurement: reading rows is not the step's work
        try:
            return measure_peak(lambda: self.step(x, y), self.device)
        finally:
            self.clear_grads()

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    @contextlib.contextmanager
    def preserved(self) -> Iterator[None]:
        """Gradients, buffers and RNG states as they were before the probe."""
        grads = [p.grad for p in self.params]
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        cuda = self.device.type == "cuda"
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if cuda else None
        try:
            self.clear_grads()
            yield
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            for p, g in zip(self.params, grads, strict=True):
                p.grad = g
            torch.set_rng_state(rng)
            if cuda_rng is not None:  # saved above on CUDA only
                torch.cuda.set_rng_state(cuda_rng, self.device)
                torch.cuda.empty_cache()


def _local_bytes(params: Iterable[torch.Tensor]) -> int:
    out = 0
    for p in params:
        t = p.to_local() if hasattr(p, "to_local") else p
        out += t.numel() * t.element_size()
    return out


def _unseen_bytes(probe: _Probe, per_rank: int, device: torch.device) -> tuple[int, str]:
    """Memory the training step will hold that one forward+backward does not show."""
    adam = 2 * _local_bytes(probe.params)
    how = f"AdamW moments {adam / MIB:.2f} MiB"
    if device.type == "cuda":
        return adam, how
    x, y = probe.sample(1)
    rows = per_rank * (x.numel() * 4 + y.numel() * 4)  # read_rows: float32 copies of the slice
    return adam + rows, how + f" + host copy of the {per_rank}-row slice {rows / MIB:.2f} MiB"


def _by_trial(
    probe: _Probe, per_rank: int, budget: int, extra: int, facts: dict[str, Any]
) -> MicroBatchChoice:
    """Largest first; the first candidate that runs and stays within the budget wins."""
    trials: list[_Trial] = []
    for m in reversed(divisors(per_rank)):
        reading = None
        try:
            reading = probe.peak(m)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_oom(e):
                raise
        if reading is None:  # out of the except block: the traceback's tensors are freed now
            trials.append({"micro_batch": m, "result": "out of memory"})
            if probe.device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        need = reading.bytes + extra
        trials.append({"micro_batch": m, "peak_bytes": reading.bytes, "need_bytes": need})
        if need <= budget or m == 1:
            facts.update(trials=trials, measure=reading.how)
            tried = ", ".join(_trial_text(t) for t in trials[:-1])
            fits = "fits" if need <= budget else "is over the budget but is the smallest"
            why = (
                f"auto (trial): {m} of per-rank {per_rank} {fits}: forward+backward peak "
                f"{reading.bytes / MIB:.1f} MiB ({reading.how}) + {facts['unseen']} = "
                f"{need / MIB:.1f} MiB vs budget {budget / MIB:.1f} MiB ({facts['budget']})"
                + (f"; larger tried: {tried}" if tried else "")
            )
            return MicroBatchChoice(m, why, facts)
    raise OutOfMemory(
        "train.micro_batch=auto: even a micro-batch of 1 row runs out of memory "
        f"on {probe.device}; use a smaller model (model.d_model, model.layers), "
        "train.precision=bf16, or more ranks"
    )


def _trial_text(t: _Trial) -> str:
    if "need_bytes" in t:
        return f"{t['micro_batch']} ({t['need_bytes'] / MIB:.1f} MiB, over)"
    return f"{t['micro_batch']} (out of memory)"


def _by_fit(
    probe: _Probe,
    per_rank: int,
    budget: int,
    extra: int,
    facts: dict[str, Any],
    probe_rows: int,
) -> MicroBatchChoice:
    """Peak at two sizes -> fixed + per-row bytes -> the largest divisor predicted to fit."""
    b = min(per_rank, max(2, probe_rows))
    a = max(1, b // 2)
    probe.peak(a)  # warm-up: lazy allocations (thread pools, workspaces) happen once
    pa, pb = probe.peak(a), probe.peak(b)
    slope = (pb.bytes - pa.bytes) / (b - a)
    if slope <= 0:  # too small to see above the allocator's granularity: all of it per row
        slope, note = pb.bytes / b, " (no growth seen between the sizes: peak/rows used)"
    else:
        note = ""
    fixed = max(0.0, pb.bytes - slope * b)
    facts.update(
        measure=pb.how,
        sizes=[a, b],
        peaks=[pa.bytes, pb.bytes],
        bytes_per_row=slope,
        fixed_bytes=fixed,
    )
    predicted = {m: int(fixed + slope * m + extra) for m in divisors(per_rank)}
    fits = [m for m, need in predicted.items() if need <= budget]
    m = max(fits) if fits else 1
    facts["predicted_bytes"] = predicted[m]
    verdict = "fits" if fits else "is the smallest; even it is predicted over the budget"
    why = (
        f"auto (fit): {m} of per-rank {per_rank} {verdict}: {pb.how} at {a} and {b} rows = "
        f"{pa.bytes / MIB:.2f} and {pb.bytes / MIB:.2f} MiB -> {slope / MIB:.3f} MiB/row{note} + "
        f"{fixed / MIB:.2f} MiB fixed, + {facts['unseen']} -> "
        f"predicted {predicted[m] / MIB:.1f} MiB "
        f"vs budget {budget / MIB:.1f} MiB ({facts['budget']})"
    )
    return MicroBatchChoice(m, why, facts)


def agree_min(value: int, env: DistEnv) -> int:
    """The smallest `value` over all ranks, on every rank (identity at world size 1).

    `env` is enn_core.runtime.dist.DistEnv; a CPU float64 tensor, so it travels on the gloo
    lane like the other agreement helpers."""
    if not env.distributed:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def agree_choice(choice: MicroBatchChoice, env: DistEnv) -> MicroBatchChoice:
    """Every rank takes the smallest micro-batch any rank chose (a collective: all ranks call)."""
    m = agree_min(choice.micro_batch, env)
    if m == choice.micro_batch:
        return choice
    return replace(
        choice,
        micro_batch=m,
        reason=f"{choice.reason}; lowered to {m}, the smallest choice of any rank",
        measured={**choice.measured, "this_rank_micro_batch": choice.micro_batch},
    )
