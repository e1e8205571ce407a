"""The warm-up + cosine schedule over the real number of steps."""

from __future__ import annotations

import pytest

from enn_core.train.schedule import lr_factor


def test_warmup_then_cosine_over_real_steps():
    f = [lr_factor(s, total_steps=100, warmup_steps=10, min_lr_ratio=0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False))  # decays monotonically
    assert f[-1] == pytest.approx(0.1, abs=1e-3)  # reaches the floor at the real last step
    short = [lr_factor(s, total_steps=4, warmup_steps=10, min_lr_ratio=0.0) for s in range(4)]
    assert short[-1] < short[1]  # warm-up capped: a short run still decays
