"""Tiny real components for the predict tests: a small torch model and its loader.

Module-level so spawned workers can unpickle the loader by reference.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

OUT_SHAPE = (3, 4)


class TinyModel(nn.Module):
    """[B, F] -> [B, 3, 4]: a seeded linear map plus a nonlinearity, in 'real units'."""

    def __init__(self, n_features: int = 3, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = nn.Linear(n_features, int(np.prod(OUT_SHAPE)))
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(self.lin.weight.shape, generator=g))
            self.lin.bias.copy_(torch.randn(self.lin.bias.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)).reshape(x.shape[0], *OUT_SHAPE) * 10 + 80


def load_tiny(n_features: int = 3, seed: int = 0) -> TinyModel:
    return TinyModel(n_features, seed).eval()


def make_features(n: int, f: int = 3, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, f)).astype(np.float32)
