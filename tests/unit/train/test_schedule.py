"""The warm-up + cosine schedule over the real number of steps."""

from __future__ import annotations

import pytest
import torch

from enn_core.config import load_config
from enn_core.runtime.memory import host_peak
from enn_core.train.schedule import build_optimizer, lr_factor


def test_warmup_then_cosine_over_real_steps():
    f = [lr_factor(s, total_steps=100, warmup_steps=10, min_lr_ratio=0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False))  # decays monotonically
    assert f[-1] == pytest.approx(0.1, abs=1e-3)  # reaches the floor at the real last step
    short = [lr_factor(s, total_steps=4, warmup_steps=10, min_lr_ratio=0.0) for s in range(4)]
    assert short[-1] < short[1]  # warm-up capped: a short run still decays


def _adamw_steps(opt_of, steps: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(64, 48), (48,), (1,)]]
    opt = opt_of(ps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 + 0.1 * k)
    for k in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g) * 10.0 ** (k % 3 - 1)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return [*ps, *(opt.state[p][m] for p in ps for m in ("exp_avg", "exp_avg_sq"))]


def test_the_cpu_optimizer_is_foreachs_bytes_without_its_whole_update_temporary():
    """build_optimizer on the CPU: bit-identical to AdamW's foreach (what it was before), and
    a step's growth stays well under one unit of the weights (foreach's sqrt of the second
    moments is one whole unit: issue 55)."""
    cfg = load_config(None, ["train.weight_decay=0.01"])
    ours = _adamw_steps(lambda ps: build_optimizer(ps, cfg.train))
    ref = _adamw_steps(
        lambda ps: torch.optim.AdamW(ps, lr=cfg.train.lr, weight_decay=0.01, foreach=True)
    )
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    # 16 tensors of 4 MB: the per-tensor loop's temporaries are a tensor's, not the model's
    ps = [torch.nn.Parameter(torch.zeros(1024, 1024)) for _ in range(16)]
    opt = build_optimizer(ps, cfg.train)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()  # creates the two moments
    weights = sum(p.numel() * p.element_size() for p in ps)
    grown = host_peak(opt.step).bytes
    assert grown < 0.5 * weights, f"a step grew {grown / 2**20:.0f} MiB for {weights >> 20} MiB"
