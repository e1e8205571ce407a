"""Losses: values against closed forms, fp32 under autocast, the learned Student-t scale."""

from __future__ import annotations

import math

import pytest
import torch

from enn_core.config import TrainConfig
from enn_core.losses import HuberLoss, MSELoss, StudentTNLL, make_loss


def test_mse_and_huber_values():
    pred, target = torch.zeros(4), torch.tensor([0.5, -0.5, 2.0, -3.0])
    assert MSELoss()(pred, target).item() == pytest.approx((0.25 + 0.25 + 4 + 9) / 4)
    # Huber delta 1: 0.5 r^2 inside, |r| - 0.5 outside.
    assert HuberLoss(1.0)(pred, target).item() == pytest.approx((0.125 + 0.125 + 1.5 + 2.5) / 4)


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


@pytest.mark.parametrize("name", ["mse", "huber", "student_t"])
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
