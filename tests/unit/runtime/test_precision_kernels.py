"""Precision policy, attention backend selection (CPU, and CUDA when present), compile fallback."""

from __future__ import annotations

import pytest
import torch

from enn_core.config import TrainConfig
from enn_core.errors import ConfigError
from enn_core.losses import MSELoss
from enn_core.model import build_model, get_attention_backend, use_attention_backend
from enn_core.model.layers import attention
from enn_core.runtime.kernels import (
    apply_attention,
    choose_attention,
    maybe_compile,
    reference_attention,
    run_backend,
)
from enn_core.runtime.precision import choose_precision
from tests.fixtures.model import make_features

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _qkv(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 2, 11, 8, generator=g).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_cpu_backends_match_reference(backend):
    q, k, v = _qkv()
    torch.testing.assert_close(
        run_backend(backend, q, k, v), reference_attention(q, k, v), rtol=1e-5, atol=1e-5
    )
    with use_attention_backend(backend):
        assert get_attention_backend() == backend
        torch.testing.assert_close(
            attention(q, k, v), reference_attention(q, k, v), rtol=1e-5, atol=1e-5
        )
    assert get_attention_backend() is None


def test_choose_attention_cpu_records_probes_and_exclusions():
    d = choose_attention(TrainConfig(), "cpu")
    assert d.backend in ("flash", "math") and d.probes[d.backend]["ok"]
    assert d.probes[d.backend]["max_abs_err"] < 1e-4
    for name in ("efficient", "cudnn"):
        assert not d.probes[name]["ok"] and "CUDA-only" in d.probes[name]["error"]
    forced = choose_attention(TrainConfig(attention="math"), "cpu")
    assert forced.backend == "math" and "train.attention=math" in forced.reason
    with pytest.raises(ConfigError, match="CUDA-only"):
        choose_attention(TrainConfig(attention="efficient"), "cpu")


def test_model_under_each_backend_agrees(manifest, tiny_cfg):
    model = build_model(tiny_cfg, manifest).eval()
    x = torch.from_numpy(make_features(4))
    outs = {}
    for name in ("math", "flash"):
        apply_attention(choose_attention(TrainConfig(attention=name), "cpu"))
        try:
            outs[name] = model(x)
        finally:
            apply_attention(None)
    torch.testing.assert_close(outs["math"], outs["flash"], rtol=1e-5, atol=1e-5)


def test_forced_backend_really_runs():
    # The model's attention runs inside sdpa_kernel([chosen]): a backend that cannot run the
    # inputs raises instead of silently falling back (efficient is CUDA-only on CPU).
    q, k, v = _qkv()
    with use_attention_backend("efficient"), pytest.raises(RuntimeError):
        attention(q, k, v)


def test_precision_policy_cpu():
    auto = choose_precision(TrainConfig(), "cpu")
    assert auto.name == "fp32" and not auto.use_grad_scaler and "auto" in auto.reason
    bf16 = choose_precision(TrainConfig(precision="bf16"), "cpu")
    assert bf16.dtype == torch.bfloat16 and bf16.grad_scaler() is None
    fp16 = choose_precision(TrainConfig(precision="fp16"), "cpu")
    assert fp16.use_grad_scaler and fp16.grad_scaler() is not None
    assert set(auto.as_record()) == {"precision", "precision_reason", "grad_scaler"}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_training_step_each_precision(manifest, tiny_cfg, precision):
    model = build_model(tiny_cfg, manifest)
    dec = choose_precision(TrainConfig(precision=precision), "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = dec.grad_scaler()
    x, y = torch.from_numpy(make_features(4)), torch.randn(4, 5, 4)
    with dec.autocast():
        pred = model(x)
        loss = MSELoss()(pred, y)
    assert pred.dtype == torch.float32 and loss.dtype == torch.float32  # head and loss in fp32
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # An inner block did run in low precision under autocast.
    if precision != "fp32":
        with dec.autocast():
            h = model.blocks[0].mlp.fc1(torch.randn(2, 16))
        assert h.dtype == dec.dtype


def test_compile_disabled_and_forced_fallback(manifest, tiny_cfg):
    model = build_model(tiny_cfg, manifest).eval()
    same, dec = maybe_compile(model, enabled=False)
    assert same is model and not dec.compiled and "train.compile=false" in dec.reason
    eager, dec = maybe_compile(model, enabled=True, backend="no_such_backend")
    assert eager is model and not dec.compiled and "fell back to eager" in dec.reason


@pytest.mark.timeout(120)
def test_compile_backend_failure_falls_back_to_eager(manifest):
    from enn_core.config.model import ModelConfig

    model = build_model(
        ModelConfig(preset="tabular", d_model=8, heads=2, layers=1, embed_dim=2), manifest
    )
    x = torch.from_numpy(make_features(3))

    def broken_backend(gm, example_inputs):
        raise RuntimeError("forced compiler failure")

    try:
        out_model, dec = maybe_compile(model, enabled=True, example=x, backend=broken_backend)
    finally:
        torch._dynamo.reset()
    assert out_model is model and not dec.compiled
    assert "forced compiler failure" in dec.reason and "fell back to eager" in dec.reason
    torch.testing.assert_close(out_model(x), model(x))


@gpu
@pytest.mark.gpu
def test_cuda_attention_and_precision(manifest, tiny_cfg):
    dec = choose_precision(TrainConfig(), "cuda")
    assert dec.name in ("bf16", "fp16")
    att = choose_attention(TrainConfig(), "cuda", dtype=dec.dtype)
    assert att.probes[att.backend]["ok"] and set(att.probes) >= {att.backend}
    model = build_model(tiny_cfg, manifest).cuda()
    apply_attention(att)
    try:
        with dec.autocast():
            y = model(torch.from_numpy(make_features(4)).cuda())
    finally:
        apply_attention(None)
    assert y.dtype == torch.float32 and torch.isfinite(y).all()
