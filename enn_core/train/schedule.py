"""Optimizer and learning-rate schedule: AdamW, linear warm-up, then cosine decay.

The cosine horizon is the real number of optimizer steps (steps per epoch x epochs, as the
sampler counts them), not an estimate: ENN-PyTorch's horizon was 4x too long, so its rate
never decayed. Warm-up is capped at half the run so a short run still decays.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from enn_core.config import TrainConfig


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak rate at optimizer step `step` (0-based)."""
    warmup = min(warmup_steps, total_steps // 2)
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(total_steps - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over `params`. On an accelerator, `foreach` (its multi-tensor kernels; FSDP2's
    DTensor parameters included). On the CPU, torch's per-tensor loop: the same kernels one
    tensor at a time, so the same bytes (tests/unit/train/test_schedule.py), without foreach's
    temporary of the whole update (its sqrt of the second moments: one more unit of the
    rank's weights at each step's peak, issue 55)."""
    params = list(params)
    foreach = any(p.device.type != "cpu" for p in params)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=foreach)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up then cosine over `total_steps` applied optimizer steps."""

    def factor(step: int) -> float:
        return lr_factor(
            step,
            total_steps=total_steps,
            warmup_steps=cfg.warmup_steps,
            min_lr_ratio=cfg.min_lr_ratio,
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
