"""Out-of-memory back-off: halve the micro-batch, double accumulation, retry the step.

The effective (global) batch never changes, so a backed-off step computes the same update
as the step without back-off up to summation order. Every back-off is recorded; after
`max_backoffs` (or when the micro-batch is already 1) training stops with an error that
says what to change. The decision is agreed across ranks by an all-reduce so every rank
runs the retried step with the same plan (FSDP needs every rank in every collective).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from enn_core.errors import TrainingError
from enn_core.runtime.sampler import Plan


def is_oom(err: BaseException) -> bool:
    """A real or injected out-of-memory error (CUDA raises OutOfMemoryError; CPU allocators
    raise RuntimeError with this text)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


@dataclass
class MemoryGovernor:
    """The current micro-batch plan and the record of every back-off."""

    plan: Plan
    max_backoffs: int
    history: list[dict] = field(default_factory=list)

    def back_off(self, *, epoch: int, step: int, reason: str) -> Plan:
        """Halve the micro-batch (same global batch); TrainingError when no room is left."""
        old = self.plan
        if len(self.history) >= self.max_backoffs or old.micro_batch <= 1 or old.micro_batch % 2:
            raise TrainingError(
                f"out of memory at epoch {epoch} step {step} with micro_batch={old.micro_batch} after "
                f"{len(self.history)} back-offs (limit train.max_oom_backoffs={self.max_backoffs}); "
                f"lower train.batch_size or set train.micro_batch to a smaller power of two, "
                f"or use train.precision=bf16"
            )
        self.plan = old.halved()
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
