"""The training objective over a micro-batch with padding rows.

enn_core.losses returns the mean over all cells; a micro-batch's real rows form a prefix
(padding sits at the end of the last global batch), so the weighted sum of per-row losses is
`loss(real rows) x n_real`. A micro-batch with no real rows still runs forward and backward
(FSDP2 needs every rank in every collective) with a zero loss that keeps the graph.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def real_prefix(weights: np.ndarray) -> int:
    """Number of real rows; they must come first (the sampler pads at the end)."""
    n = int((weights > 0).sum())
    if n and not bool((weights[:n] > 0).all()):
        raise ValueError("padding rows must follow the real rows in a micro-batch")
    return n


def weighted_loss_sum(
    loss: nn.Module, pred: torch.Tensor, target: torch.Tensor, weights: np.ndarray
) -> torch.Tensor:
    """Sum over real rows of the per-row loss (each row's mean over its cells)."""
    n = real_prefix(weights)
    if n == 0:
        return pred.sum() * 0.0
    if n < len(weights):
        pred, target = pred[:n], target[:n]
    return loss(pred, target) * n
