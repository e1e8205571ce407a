"""A temporal convolution over the hour axis: an example of your own model in the pipeline.

`model.preset: custom`, `model.factory: examples.tcn.model:build` (README, "Your own model").
The pipeline encodes each row's features (embeddings, cyclic sin/cos, scaled numbers) into
`spec.encoded_dim` numbers; this module turns them into one feature map per hour, runs
residual 1-D convolutions along the hours (each a `blocks` entry: one FSDP2 unit), and reads
out one value per (section, hour) cell in normalized label units.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from enn_core.model import ModelSpec


class ConvBlock(nn.Module):
    """x + conv(gelu(norm(x))) along the hours; the padding keeps the length."""

    def __init__(self, channels: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(1, channels)
        pad = dilation * (kernel - 1) // 2
        self.conv = nn.Conv1d(channels, channels, kernel, padding=pad, dilation=dilation)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(self.act(self.norm(x)))


class TemporalConv(nn.Module):
    def __init__(
        self, encoded_dim: int, sections: int, hours: int, channels: int, kernel: int, layers: int
    ) -> None:
        super().__init__()
        self.channels, self.hours = channels, hours
        self.stem = nn.Linear(encoded_dim, channels * hours)
        self.hour_embed = nn.Parameter(torch.zeros(channels, hours))
        self.blocks = nn.ModuleList(
            ConvBlock(channels, kernel, dilation=2**i) for i in range(layers)
        )
        self.head = nn.Conv1d(channels, sections, 1)

    def forward(self, enc: torch.Tensor) -> torch.Tensor:
        h = self.stem(enc).reshape(-1, self.channels, self.hours) + self.hour_embed
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # [B, sections, hours]


def build(spec: ModelSpec, channels: int = 32, kernel: int = 3, layers: int = 2) -> nn.Module:
    """The factory: `spec` is the pipeline's ModelSpec; the keywords are `model.options`."""
    if len(spec.label_shape) != 2:
        raise ValueError(
            f"examples.tcn needs labels [sections, hours], not {list(spec.label_shape)}"
        )
    if kernel % 2 == 0:
        raise ValueError(f"kernel={kernel} must be odd (the output keeps the hours)")
    sections, hours = spec.label_shape
    return TemporalConv(spec.encoded_dim, sections, hours, channels, kernel, layers)
