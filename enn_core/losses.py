"""Training losses in normalized label units, always computed in fp32 (autocast off).

- `mse`: mean squared error (its best constant is the mean).
- `l1`: mean absolute error (its best constant is the median): the loss of the metric validate
  reports, so early stopping (on the validation loss) stops where the reported metric is best.
- `quantile`: the pinball loss at `train.quantile` (0.5 is half of `l1`): a prediction of that
  quantile of the label, e.g. 0.9 for a cautious upper figure.
- `huber`: Huber with `delta` (normalized units).
- `student_t`: Student-t negative log-likelihood with a learned scale; the log-scale is a
  parameter of the loss module, so the trainer adds `loss.parameters()` to the optimizer
  (and the loss state to its checkpoint). Heavy tails make it robust to outlier cells.

`make_loss(train_cfg, preset)` picks one from `train.loss`; `resolve_loss` says what `auto` (the
default) becomes for a preset and why (measured: docs/design.md, "Training objective").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from enn_core.errors import ConfigError
from enn_core.runtime.precision import fp32_region

if TYPE_CHECKING:
    from enn_core.config.train import TrainConfig


class _FP32Loss(nn.Module):
    """Runs `compute` on fp32 copies of its inputs with autocast off."""

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if pred.shape != target.shape:
            raise ValueError(
                f"loss: prediction shape {tuple(pred.shape)} != target shape {tuple(target.shape)}"
            )
        with fp32_region(pred.device.type):
            return self.compute(pred.float(), target.float())

    def compute(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


class MSELoss(_FP32Loss):
    def compute(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(pred, target)


class L1Loss(_FP32Loss):
    def compute(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.l1_loss(pred, target)


class QuantileLoss(_FP32Loss):
    """Mean pinball loss at quantile q: q * (y - p) above the prediction, (1 - q) * (p - y)
    below it."""

    def __init__(self, q: float = 0.5) -> None:
        super().__init__()
        if not 0 < q < 1:
            raise ConfigError(f"train.quantile={q} must be in (0, 1) (0.5: the median)")
        self.q = float(q)

    def compute(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        diff = target - pred
        return torch.maximum(self.q * diff, (self.q - 1) * diff).mean()


class HuberLoss(_FP32Loss):
    def __init__(self, delta: float = 1.0) -> None:
        super().__init__()
        if delta <= 0:
            raise ConfigError(f"train.huber_delta={delta} must be > 0 (e.g. 1.0)")
        self.delta = delta

    def compute(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.huber_loss(pred, target, delta=self.delta)


class StudentTNLL(_FP32Loss):
    """Mean NLL of target under Student-t(df, loc=pred, scale=exp(log_scale))."""

    def __init__(self, df: float = 4.0, init_scale: float = 1.0) -> None:
        super().__init__()
        if df <= 0 or init_scale <= 0:
            raise ConfigError(f"student_t loss: df={df} and init_scale={init_scale} must be > 0")
        self.df = float(df)
        self.log_scale = nn.Parameter(torch.tensor(math.log(init_scale), dtype=torch.float32))
        self.const = math.lgamma(df / 2) - math.lgamma((df + 1) / 2) + 0.5 * math.log(df * math.pi)

    @property
    def scale(self) -> torch.Tensor:
        return self.log_scale.exp()

    def compute(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        z = (target - pred) / self.log_scale.exp()
        nll = self.const + self.log_scale + 0.5 * (self.df + 1) * torch.log1p(z * z / self.df)
        return nll.mean()


# What train.loss=auto becomes per model preset, and why (measured on validation rows of several
# datasets: docs/design.md, "Training objective").
AUTO_LOSS: dict[str, tuple[str, str]] = {
    "tabular": ("l1", "the tabular preset's default: the loss of the reported metric (MAE)"),
    "spatiotemporal": ("mse", "the spatiotemporal preset's default"),
    "custom": ("mse", "your own model's default"),
}


def resolve_loss(train_cfg: TrainConfig, preset: str) -> tuple[str, str]:
    """(the loss train.loss names, why): `auto` becomes the preset's measured default."""
    if train_cfg.loss != "auto":
        return train_cfg.loss, f"train.loss={train_cfg.loss}"
    loss, why = AUTO_LOSS.get(preset, AUTO_LOSS["custom"])
    return loss, f"train.loss=auto: {why}"


def make_loss(train_cfg: TrainConfig, preset: str = "custom", df: float = 4.0) -> nn.Module:
    """The loss named by train.loss (`auto`: the preset's, `resolve_loss`; huber uses
    train.huber_delta, quantile train.quantile)."""
    loss, _ = resolve_loss(train_cfg, preset)
    if loss == "mse":
        return MSELoss()
    if loss == "l1":
        return L1Loss()
    if loss == "quantile":
        return QuantileLoss(train_cfg.quantile)
    if loss == "huber":
        return HuberLoss(train_cfg.huber_delta)
    if loss == "student_t":
        return StudentTNLL(df=df)
    raise ConfigError(
        f"train.loss={train_cfg.loss!r} is unknown; use auto, mse, l1, quantile, huber or student_t"
    )
