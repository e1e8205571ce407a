"""Losses: values against closed forms, fp32 under autocast, the learned Student-t scale."""

from __future__ import annotations

import math

import pytest
import torch

from enn_core.config import TrainConfig
from enn_core.losses import (
    HuberLoss,
    L1Loss,
    MSELoss,
    QuantileLoss,
    StudentTNLL,
    make_loss,
    resolve_loss,
)


def test_mse_and_huber_values():
    pred, target = torch.zeros(4), torch.tensor([0.5, -0.5, 2.0, -3.0])
    assert MSELoss()(pred, target).item() == pytest.approx((0.25 + 0.25 + 4 + 9) / 4)
    # Huber delta 1: 0.5 r^2 inside, |r| - 0.5 outside.
    assert HuberLoss(1.0)(pred, target).item() == pytest.approx((0.125 + 0.125 + 1.5 + 2.5) / 4)


def test_l1_and_quantile_values_and_their_best_constants():
    pred, target = torch.zeros(4), torch.tensor([0.5, -0.5, 2.0, -3.0])
    assert L1Loss()(pred, target).item() == pytest.approx(6.0 / 4)
    assert QuantileLoss(0.5)(pred, target).item() == pytest.approx(0.5 * 6.0 / 4)
    # q = 0.9: 0.9 x the excess above the prediction, 0.1 x the shortfall below it
    assert QuantileLoss(0.9)(pred, target).item() == pytest.approx((0.9 * 2.5 + 0.1 * 3.5) / 4)
    # the constant minimising each is the median (l1) or the 0.9 quantile, not the mean
    skewed = torch.tensor([0.0, 0.0, 1.0, 1.0, 2.0, 50.0, 100.0])
    grid = torch.linspace(-1, 110, 11101)
    for loss, want in ((L1Loss(), 1.0), (QuantileLoss(0.9), 100.0), (MSELoss(), 22.0)):
        values = torch.stack([loss(torch.full_like(skewed, float(c)), skewed) for c in grid])
        assert float(grid[values.argmin()]) == pytest.approx(want, abs=0.02)


def test_auto_loss_is_the_presets_measured_default():
    assert resolve_loss(TrainConfig(), "tabular")[0] == "l1"
    assert resolve_loss(TrainConfig(), "spatiotemporal")[0] == "mse"
    assert resolve_loss(TrainConfig(loss="huber"), "tabular") == ("huber", "train.loss=huber")
    assert isinstance(make_loss(TrainConfig(), "tabular"), L1Loss)
    assert isinstance(make_loss(TrainConfig(loss="quantile", quantile=0.2)), QuantileLoss)


def test_student_t_matches_torch_distribution_and_learns_scale():
    loss = StudentTNLL(df=4.0, init_scale=1.0)
    pred, target = (
        torch.zeros(200),
        torch.randn(200, generator=torch.Generator().manual_seed(0)) * 3.0,
    )
    ref = -torch.distributions.StudentT(4.0, 0.0, 1.0).log_prob(target).mean()
    assert loss(pred, target).item() == pytest.approx(ref.item(), rel=1e-5)
    assert [n for n, _ in loss.named_parameters()] == ["log_scale"]
    opt = torch.optim.Adam(loss.parameters(), lr=0.05)
    for _ in range(200):
        opt.zero_grad()
        loss(pred, target).backward()
        opt.step()
    assert 1.5 < loss.scale.item() < 3.5  # the scale moved toward the data's spread (std 3)


@pytest.mark.parametrize("name", ["mse", "l1", "quantile", "huber", "student_t"])
def test_losses_fp32_under_autocast(name):
    loss = make_loss(TrainConfig(loss=name))
    pred = torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = loss(pred, torch.randn(3, 4))
    assert value.dtype == torch.float32 and math.isfinite(value.item())
    value.backward()
    assert pred.grad is not None


def test_shape_mismatch_named():
    with pytest.raises(ValueError, match="shape"):
        MSELoss()(torch.zeros(2, 3), torch.zeros(3, 2))
