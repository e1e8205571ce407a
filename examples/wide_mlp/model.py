"""A residual MLP sized by its width: a model of any size for the pipeline's every stage.

`model.preset: custom`, `model.factory: examples.wide_mlp.model:build`,
`model.options: {width: 1024, blocks: 8}`. Each row's encoded features go through a linear
stem to `width` numbers, then `blocks` residual blocks (each a `blocks` entry: one FSDP2 unit)
of LayerNorm, GELU and a `width x width` linear layer, and a linear read-out of every label
cell. The parameters are about `blocks x width^2`: width 1024 and 8 blocks are 8.5 million,
width 3584 are 103 million, width 7936 are 504 million (bench/bench_model_scale.py sizes it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from enn_core.model import ModelSpec


class Block(nn.Module):
    """x + linear(gelu(norm(x)))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(self.act(self.norm(x)))


class WideMLP(nn.Module):
    def __init__(
        self, encoded_dim: int, label_shape: tuple[int, ...], width: int, blocks: int
    ) -> None:
        super().__init__()
        self.label_shape = tuple(label_shape)
        self.stem = nn.Linear(encoded_dim, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, math.prod(self.label_shape))

    def forward(self, enc: torch.Tensor) -> torch.Tensor:
        h = self.stem(enc)
        for block in self.blocks:
            h = block(h)
        return self.head(h).reshape(-1, *self.label_shape)


def build(spec: ModelSpec, width: int = 256, blocks: int = 4) -> nn.Module:
    """The factory: `spec` is the pipeline's ModelSpec; the keywords are `model.options`."""
    if width < 1 or blocks < 1:
        raise ValueError(f"width={width} and blocks={blocks} must be >= 1")
    return WideMLP(spec.encoded_dim, tuple(spec.label_shape), width, blocks)
