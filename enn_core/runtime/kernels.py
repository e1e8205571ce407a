"""Attention kernel selection and optional torch.compile, each with its decision and reason.

`choose_attention(train_cfg, device)` probes the candidate SDPA backends once (forward and
backward on small tensors, compared with a plain softmax(QK^T)V reference) and picks the
first that runs and gives finite, matching output:

- CPU: flash, math (efficient and cuDNN are CUDA-only: recorded as excluded, with why);
- CUDA: flash, efficient, cudnn, math.

`train.attention` forces one backend (its probe must pass, or the error names the fix).
`apply_attention(decision)` makes the model run every attention call inside
`sdpa_kernel([backend])` (enn_core.model.layers), so the recorded backend is the one that
ran. `maybe_compile(model, enabled, example)` compiles and falls back to eager on failure.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict, cast

import torch
from torch import nn
from torch.nn.attention import sdpa_kernel

from enn_core.errors import ConfigError
from enn_core.model.layers import BACKENDS, set_attention_backend

if TYPE_CHECKING:
    from enn_core.config.train import TrainConfig

CPU_CANDIDATES = ("flash", "math")
CUDA_CANDIDATES = ("flash", "efficient", "cudnn", "math")
CUDA_ONLY = {
    "efficient": "CUDA-only (memory-efficient kernel)",
    "cudnn": "CUDA-only (cuDNN kernel)",
}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


class ProbeResult(TypedDict):
    """One backend's probe: whether it passed, why not, and its error against the reference."""

    ok: bool
    error: str | None
    max_abs_err: float | None


@dataclass(frozen=True)
class AttentionDecision:
    backend: str
    reason: str
    probes: dict[str, ProbeResult] = field(default_factory=dict)

    def as_record(self) -> dict[str, str | dict[str, ProbeResult]]:
        return {
            "attention": self.backend,
            "attention_reason": self.reason,
            "attention_probes": self.probes,
        }


Decision = AttentionDecision


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain softmax(Q K^T / sqrt(d)) V in fp32: the yardstick every backend is held to."""
    q, k, v = q.float(), k.float(), v.float()
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v


def run_backend(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA forced onto one backend (raises if that backend cannot run these inputs)."""
    with sdpa_kernel([BACKENDS[name]]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def probe_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    heads: int = 4,
    head_dim: int = 16,
    length: int = 24,
) -> ProbeResult:
    """Forward + backward of one backend on random inputs: {ok, error, max_abs_err}."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (
        torch.randn(2, heads, length, head_dim, generator=gen).to(device, dtype).requires_grad_()
        for _ in range(3)
    )
    try:
        out = run_backend(name, q, k, v)
        out.float().square().sum().backward()
    except RuntimeError as e:
        return {"ok": False, "error": str(e).splitlines()[0][:200], "max_abs_err": None}
    grads_finite = all(t.grad is not None and bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
    if not bool(torch.isfinite(out).all()) or not grads_finite:
        return {"ok": False, "error": "non-finite output or gradient", "max_abs_err": None}
    err = float(
        (out.detach().float() - reference_attention(q.detach(), k.detach(), v.detach())).abs().max()
    )
    tol = TOLERANCE.get(dtype, 1e-2)
    if err > tol:
        return {
            "ok": False,
            "error": f"differs from the reference by {err:.3g} > {tol}",
            "max_abs_err": err,
        }
    return {"ok": True, "error": None, "max_abs_err": err}


def candidates(device: torch.device) -> tuple[tuple[str, ...], dict[str, str]]:
    """(backends to probe in order, excluded backends with why)."""
    if device.type == "cuda":
        return CUDA_CANDIDATES, {}
    return CPU_CANDIDATES, {n: f"{why}; device is {device.type}" for n, why in CUDA_ONLY.items()}


def choose_attention(
    train_cfg: TrainConfig,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    heads: int = 4,
    head_dim: int = 16,
) -> AttentionDecision:
    """Probe candidates once; the first that passes wins (or the forced one, which must pass)."""
    device = torch.device(device)
    order, excluded = candidates(device)
    probes: dict[str, ProbeResult] = {
        n: {"ok": False, "error": f"excluded: {why}", "max_abs_err": None}
        for n, why in excluded.items()
    }
    forced = train_cfg.attention
    if forced != "auto":
        if forced in excluded:
            raise ConfigError(
                f"train.attention={forced} is {excluded[forced]}; "
                "use train.attention=auto, flash or math"
            )
        probes[forced] = probe_backend(forced, device, dtype, heads, head_dim)
        if not probes[forced]["ok"]:
            raise ConfigError(
                f"train.attention={forced} failed its probe on {device.type} "
                f"({probes[forced]['error']}); use train.attention=auto or math"
            )
        return AttentionDecision(forced, f"train.attention={forced} (probe passed)", probes)
    for name in order:
        probes[name] = probe_backend(name, device, dtype, heads, head_dim)
        if probes[name]["ok"]:
            failed = [f"{n}: {probes[n]['error']}" for n in order[: order.index(name)]]
            why = (
                f"auto: first of {list(order)} to pass the probe on "
                f"{device.type}/{str(dtype).removeprefix('torch.')}"
            )
            return AttentionDecision(
                name, why + (f" (failed: {'; '.join(failed)})" if failed else ""), probes
            )
    raise ConfigError(
        f"no attention backend passed its probe on {device}: {probes}; "
        "check the torch build or set train.attention=math"
    )


def apply_attention(decision: AttentionDecision | None) -> None:
    """Make the model run attention inside sdpa_kernel([decision.backend])
    (None: torch's choice)."""
    set_attention_backend(decision.backend if decision is not None else None)


@dataclass(frozen=True)
class CompileDecision:
    compiled: bool
    reason: str
    backend: str = "inductor"

    def as_record(self) -> dict[str, bool | str]:
        return {
            "compile": self.compiled,
            "compile_reason": self.reason,
            "compile_backend": self.backend,
        }


def maybe_compile(
    model: nn.Module,
    enabled: bool,
    example: torch.Tensor | None = None,
    backend: str | Callable[..., Any] = "inductor",
) -> tuple[nn.Module, CompileDecision]:
    """torch.compile the model, or keep it eager, with the reason.

    Compilation is lazy, so with `example` the compiled model is run once (no grad) and its
    output compared with eager: any failure, non-finite or mismatching output -> eager.
    """
    label = backend if isinstance(backend, str) else getattr(backend, "__name__", "custom")
    if not enabled:
        return model, CompileDecision(False, "train.compile=false (eager)", label)
    try:
        # torch.compile of a module returns an OptimizedModule; its stubs say only "a callable"
        compiled = cast(nn.Module, torch.compile(model, backend=backend))
        if example is not None:
            was_training = model.training
            model.eval()  # dropout off, so compiled and eager outputs are comparable
            try:
                with torch.no_grad():
                    got, want = compiled(example), model(example)
            finally:
                model.train(was_training)
            if not bool(torch.isfinite(got).all()) or not torch.allclose(
                got, want, rtol=1e-3, atol=1e-4
            ):
                return model, CompileDecision(
                    False, "compiled output differs from eager; fell back to eager", label
                )
    except Exception as e:  # noqa: BLE001 - any compiler failure means eager, and is reported
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        msg = " ".join(lines[:3])[:300] or type(e).__name__
        return model, CompileDecision(
            False, f"torch.compile failed ({type(e).__name__}: {msg}); fell back to eager", label
        )
    checked = (
        " and checked against eager on an example batch"
        if example is not None
        else " (lazy: compiles on first call)"
    )
    return compiled, CompileDecision(
        True, f"train.compile=true: compiled with {label}{checked}", label
    )
