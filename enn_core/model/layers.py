"""Building blocks of the ENN presets: axis attention, cross-attention, modulated blocks,
the fp32 head, and the one place attention runs (`attention`).

Attention goes through `torch.nn.functional.scaled_dot_product_attention`. When the runtime
has chosen a backend (enn_core.runtime.kernels.choose_attention -> set_attention_backend),
every call runs inside `sdpa_kernel([that backend])`, so the backend that is recorded is the
one that ran: torch raises instead of silently picking another. With no backend set (the
default, and what export uses) SDPA picks its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS: dict[str, SDPBackend] = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}

_backend: str | None = None  # process-wide: one model per worker process


def set_attention_backend(name: str | None) -> None:
    """Run all later attention calls inside sdpa_kernel([name]); None = torch's own choice."""
    global _backend
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; use one of {sorted(BACKENDS)}")
    _backend = name


def get_attention_backend() -> str | None:
    return _backend


@contextlib.contextmanager
def use_attention_backend(name: str | None) -> Iterator[None]:
    """Temporarily set the backend (probes, tests, export with None)."""
    before = _backend
    set_attention_backend(name)
    try:
        yield
    finally:
        set_attention_backend(before)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
) -> torch.Tensor:
    """SDPA over [..., heads, L, dh], inside the chosen backend when one is set."""
    if _backend is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    with sdpa_kernel([BACKENDS[_backend]]):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)


class MLP(nn.Module):
    """Per-token feed-forward: Linear -> GELU -> Linear."""

    def __init__(self, d: int, hidden: int, dropout: float = 0.0, d_out: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d_out or d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class AxisAttention(nn.Module):
    """Self-attention along one axis of a [B, S, T, d] grid (axis 1 = sections, 2 = hours)."""

    def __init__(self, d: int, heads: int, axis: int, dropout: float = 0.0) -> None:
        super().__init__()
        if axis not in (1, 2):
            raise ValueError("axis must be 1 (sections) or 2 (hours)")
        self.heads, self.axis, self.dropout = heads, axis, dropout
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, t, d = x.shape
        # Put the attended axis in position 2: rows = (batch, other axis), sequence = this axis.
        y = x.transpose(1, 2) if self.axis == 1 else x
        n_other, length = y.shape[1], y.shape[2]
        y = y.reshape(-1, length, d)
        qkv = self.qkv(y).reshape(-1, length, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        o = attention(q, k, v, self.dropout if self.training else 0.0)
        o = self.proj(o.transpose(1, 2).reshape(-1, length, d)).reshape(b, n_other, length, d)
        return o.transpose(1, 2) if self.axis == 1 else o


class CrossAttention(nn.Module):
    """Grid tokens [B, S, T, d] attend to the sample's context tokens [B, C, d]."""

    def __init__(self, d: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        b, s, t, d = x.shape
        h, dh = self.heads, d // self.heads
        q = self.q(x.reshape(b, s * t, d)).reshape(b, s * t, h, dh).transpose(1, 2)
        kv = self.kv(ctx).reshape(b, ctx.shape[1], 2, h, dh).permute(2, 0, 3, 1, 4)
        o = attention(q, kv[0], kv[1], self.dropout if self.training else 0.0)
        return self.proj(o.transpose(1, 2).reshape(b, s, t, d))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FiLM on a [B, S, T, d] grid with per-sample [B, d] shift and scale."""
    return x * (1 + scale[:, None, None, :]) + shift[:, None, None, :]


class SpatioTemporalBlock(nn.Module):
    """Section attention, hour attention, (cross-attention), MLP; each pre-norm and residual.

    The sample's context vector modulates every sub-layer's normalised input (FiLM), so the
    features reach every block rather than only the first.
    """

    def __init__(
        self, d: int, heads: int, ffn_mult: int, dropout: float, cross: bool, film: bool
    ) -> None:
        super().__init__()
        self.film = film
        self.norms = nn.ModuleList(nn.LayerNorm(d, elementwise_affine=not film) for _ in range(3))
        self.ada = nn.Linear(d, 6 * d) if film else None
        self.attn_section = AxisAttention(d, heads, axis=1, dropout=dropout)
        self.attn_hour = AxisAttention(d, heads, axis=2, dropout=dropout)
        self.cross_norm = nn.LayerNorm(d) if cross else None
        self.cross = CrossAttention(d, heads, dropout) if cross else None
        self.mlp = MLP(d, ffn_mult * d, dropout)

    def _in(self, i: int, x: torch.Tensor, mods: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
        h = self.norms[i](x)
        return h if mods is None else modulate(h, mods[2 * i], mods[2 * i + 1])

    def forward(
        self, x: torch.Tensor, c: torch.Tensor, ctx: torch.Tensor | None = None
    ) -> torch.Tensor:
        mods = self.ada(F.gelu(c)).chunk(6, dim=-1) if self.ada is not None else None
        x = x + self.attn_section(self._in(0, x, mods))
        x = x + self.attn_hour(self._in(1, x, mods))
        if self.cross is not None and self.cross_norm is not None and ctx is not None:
            x = x + self.cross(self.cross_norm(x), ctx)
        return x + self.mlp(self._in(2, x, mods))


class ResidualBlock(nn.Module):
    """Pre-norm residual MLP block of the tabular preset."""

    def __init__(self, d: int, ffn_mult: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = MLP(d, ffn_mult * d, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class FP32Head(nn.Module):
    """LayerNorm + Linear in float32 with autocast off: the last layers never run in bf16/fp16.

    (Under FSDP2 mixed precision, shard this module with an fp32 param policy.)
    """

    def __init__(self, d: int, d_out: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, d_out)
        nn.init.normal_(self.out.weight, std=0.02)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with autocast_off(x.device.type):
            return self.out(self.norm(x.float()))


@contextlib.contextmanager
def autocast_off(device_type: str) -> Iterator[None]:
    """Autocast disabled inside (a no-op when it is off, so export graphs stay plain)."""
    if torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type=device_type, enabled=False):
            yield
    else:
        yield
