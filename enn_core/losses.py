"""Training losses in normalized label units, always computed in fp32 (autocast off).

- `mse`: mean squared error.
- `huber`: Huber with `delta` (normalized units).
- `student_t`: Student-t negative log-likelihood with a learned scale; the log-scale is a
  parameter of the loss module, so the trainer adds `loss.parameters()` to the optimizer
  (and the loss state to its checkpoint). Heavy tails make it robust to outlier cells.

`make_loss(train_cfg)` picks one from `train.loss`.
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


def make_loss(train_cfg: TrainConfig, df: float = 4.0) -> nn.Module:
    """The loss named by train.loss (huber uses train.huber_delta)."""
    if train_cfg.loss == "mse":
        return MSELoss()
    if train_cfg.loss == "huber":
        return HuberLoss(train_cfg.huber_delta)
    if train_cfg.loss == "student_t":
        return StudentTNLL(df=df)
    raise ConfigError(f"train.loss={train_cfg.loss!r} is unknown; use mse, huber or student_t")
