"""The non-finite guard: skip and count a step whose loss or gradients are not finite; after
N in a row, stop naming the first non-finite tensor and the step, with the batch saved.

Nothing is ever zeroed or sanitized (ENN-PyTorch's silent `nan_to_num` is what not to do):
a skipped step leaves the parameters and the optimizer state untouched. The saved batch
(`<run_dir>/nonfinite/rank-<r>-step-<s>.pt`: features, labels, weights, rows and the
model's state) replays with `replay_loss`, which reproduces the non-finite loss.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from enn_core.errors import TrainingError
from enn_core.model.enn import ENN
from enn_core.tensor_file import load_tensors
from enn_core.train.objective import weighted_loss_sum


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor | None]]) -> str | None:
    """The name (and first bad index) of the first tensor holding NaN or inf, in the given order."""
    for name, t in named:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        bad = ~torch.isfinite(local.detach())
        if bool(bad.any()):
            idx = tuple(int(i) for i in torch.nonzero(bad)[0].tolist())
            return f"{name}{list(idx)}"
    return None


@dataclass
class NonFiniteGuard:
    """Counts skipped steps; `record_skip` raises once `max_consecutive` skips happen in a row."""

    max_consecutive: int
    dump_dir: Path
    rank: int = 0
    consecutive: int = 0
    total_skipped: int = 0
    events: list[dict] = field(default_factory=list)

    def record_ok(self) -> None:
        self.consecutive = 0

    def record_skip(
        self, *, epoch: int, step: int, culprit: str | None, culprit_rank: int | None
    ) -> bool:
        """Count a skipped step; True when training must stop (N in a row)."""
        self.consecutive += 1
        self.total_skipped += 1
        self.events.append({"epoch": epoch, "step": step, "tensor": culprit, "rank": culprit_rank})
        return self.consecutive >= self.max_consecutive

    def first_event_of_run(self) -> dict:
        """The first skip of the current run of consecutive skips."""
        return self.events[-self.consecutive]

    def save_batch(self, step: int, batches: list, state_dict: dict | None) -> Path:
        """This rank's batch of `step` (all micro-batches) and, if given, the model state."""
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        path = self.dump_dir / f"rank-{self.rank}-step-{step}.pt"
        payload = {
            "step": step,
            "features": [torch.as_tensor(b.features) for b in batches],
            "labels": [torch.as_tensor(b.labels) for b in batches],
            "weights": [torch.as_tensor(b.weights) for b in batches],
            "rows": [torch.as_tensor(b.rows) for b in batches],
            "state_dict": state_dict,
        }
        torch.save(payload, path)
        return path

    def stop_error(self, saved: Path | None) -> TrainingError:
        first = self.first_event_of_run()
        where = f" on rank {first['rank']}" if first.get("rank") is not None else ""
        return TrainingError(
            f"{self.consecutive} non-finite steps in a row "
            f"(train.max_nonfinite_steps={self.max_consecutive}); first non-finite tensor "
            f"{first['tensor'] or 'unknown'}{where} at epoch {first['epoch']} step "
            f"{first['step']}; batch saved to {saved}; check those staged rows, or lower train.lr"
        )


def replay_loss(path: str | Path, model: ENN, loss: torch.nn.Module) -> torch.Tensor:
    """Recompute the loss of a saved non-finite batch with `model` (state loaded from the file
    when saved). Returns the weighted mean loss of the saved micro-batches."""
    payload = load_tensors(
        path, name=str(path), what="saved batch", fix="delete it and train again to save another"
    )
    if payload.get("state_dict") is not None:
        model.load_state_dict(payload["state_dict"])
    total = torch.zeros((), dtype=torch.float64)
    weight = 0.0
    with torch.no_grad():
        for x, y, w in zip(payload["features"], payload["labels"], payload["weights"], strict=True):
            total = (
                total
                + weighted_loss_sum(loss, model(x).float(), model.normalize(y), w.numpy()).double()
            )
            weight += float(w.sum())
    return total / max(weight, 1.0)
