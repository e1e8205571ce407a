"""Tiny models and data for the validate / collapse-check / export tests.

The data: three integer-coded keys (month, day type, direction) -> a small (section, hour)
grid made of additive effects plus noise. Each model has `predict(x)` (real units) like the
ENN: `Generator` is healthy (the noise-free generator itself); the others break it on purpose.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from torch import nn

from enn_core.collapse.candidates import CheckRows
from enn_core.config import CollapseConfig

N_MONTHS, N_DAYS, N_DIRS, N_SECTIONS, N_HOURS = 6, 4, 2, 3, 4
NOISE = 0.3


class Generator(nn.Module):
    """Healthy: base + month + day-type + direction effects per cell."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        shape = (N_SECTIONS, N_HOURS)
        self.register_buffer("base", 80 + 5 * torch.randn(shape, generator=g))
        self.register_buffer("month", 4 * torch.randn((N_MONTHS, *shape), generator=g))
        self.register_buffer("day", 4 * torch.randn((N_DAYS, *shape), generator=g))
        self.register_buffer("dir", 4 * torch.randn((N_DIRS, *shape), generator=g))

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        i = x.long()
        return self.base + self.month[i[:, 0]] + self.day[i[:, 1]] + self.dir[i[:, 2]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predict(x)


class Constant(Generator):
    """Collapsed: the same grid for every row."""

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.expand(x.shape[0], *self.base.shape) + 0 * x[:, :1, None]


class BatchBroadcast(Generator):
    """Batch-level broadcast bug: every row gets the batch's mean prediction."""

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        y = super().predict(x)
        return y.mean(dim=0, keepdim=True).expand_as(y)


class Compressed(Generator):
    """Under-dispersed: the right ranking, a third of the spread, an offset."""

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        y = super().predict(x)
        return self.base + 0.4 * (y - self.base) + 2.0


class Flat(Generator):
    """Flat: the base grid plus an input-dependent ripple far below the label spread."""

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        ripple = 1e-4 * torch.sin(x.sum(dim=1) * 1.7)[:, None, None]
        return self.base + ripple


class Quantized(Generator):
    """Collapses under bf16 autocast only: a linear layer over a large offset."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(N_SECTIONS * N_HOURS, N_SECTIONS * N_HOURS)
        with torch.no_grad():
            self.lin.weight.copy_(torch.eye(N_SECTIONS * N_HOURS))
            self.lin.bias.fill_(5000.0)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        y = super().predict(x).reshape(x.shape[0], -1)
        small = 0.02 * (y - 80)  # a spread of ~0.2: far below bf16's step of 32 at 5000
        return ((self.lin(small) - 5000.0) * 50.0 + 80).reshape(x.shape[0], N_SECTIONS, N_HOURS)


def dataset(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features [N, 3] float32 codes, labels [N, S, H], key array) for every key combination."""
    keys = np.array(
        list(itertools.product(range(N_MONTHS), range(N_DAYS), range(N_DIRS))), dtype=np.int64
    )
    x = keys.astype(np.float32)
    with torch.no_grad():
        y = Generator(seed).predict(torch.from_numpy(x)).numpy()
    y = y + NOISE * np.random.default_rng(seed).standard_normal(y.shape).astype(np.float32)
    return x, y, keys


def split_rows(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(train, val, test) row indices: half, a quarter, a quarter."""
    perm = np.random.default_rng(seed).permutation(n)
    a, b = n // 2, 3 * n // 4
    return np.sort(perm[:a]), np.sort(perm[a:b]), np.sort(perm[b:])


def check_rows(rows: np.ndarray | None = None) -> CheckRows:
    """The validation rows as collapse-check sees them, with both naive predictions."""
    from enn_core.baselines import conditional_naive_predict, per_cell_mean_predict

    x, y, keys = dataset()
    train, val, _ = split_rows(len(x))
    rows = val if rows is None else rows
    naive = {
        "naive_conditional": conditional_naive_predict(
            y[train], keys[train, 1:], keys[rows, 1:], ("daytype", "direction")
        ),
        "naive_cell_mean": per_cell_mean_predict(y[train], len(rows)),
    }
    return CheckRows(
        features=x[rows],
        target=y[rows],
        naive=naive,
        label_std=float(y[train].std()),
        axes=("section", "hour"),
    )


def collapse_cfg(**kw) -> CollapseConfig:
    return CollapseConfig(**{"batch_size": 16, **kw})
