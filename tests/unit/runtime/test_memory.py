"""The memory governor: out-of-memory back-off halves the micro-batch, then names what to change."""

from __future__ import annotations

import pytest

from enn_core.errors import OutOfMemory
from enn_core.runtime.memory import MemoryGovernor
from enn_core.runtime.sampler import make_plan


def test_governor_halves_then_says_what_to_change():
    g = MemoryGovernor(make_plan(8, 4, 1), max_backoffs=1)
    p = g.back_off(epoch=0, step=3, reason="oom")
    assert (p.micro_batch, p.accumulation) == (2, 4) and g.history[0]["step"] == 3
    with pytest.raises(OutOfMemory, match="train.micro_batch"):
        g.back_off(epoch=0, step=4, reason="oom")
