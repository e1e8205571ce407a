"""runtime.worker_memory_limit_mb's watch (enn_core.runtime.memory_limit) on this process's
real anonymous memory: a sample past the limit reports once, naming what was held, the limit
and what to change; the peak of each phase is kept; no limit reports nothing. The workers'
end-to-end behaviour is tests/distributed/test_memory_limit.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from enn_core.config import load_config
from enn_core.errors import ConfigError, OutOfMemory
from enn_core.runtime.memory_limit import MIB, AnonWatch, anon_bytes


def _hold(watch: AnonWatch, until) -> np.ndarray:
    """128 MiB written (resident), held until `until()` or 2 s."""
    held = np.ones(128 * MIB // 8)
    deadline = time.monotonic() + 2.0
    while not until() and time.monotonic() < deadline:
        time.sleep(0.005)
    return held


def test_past_the_limit_it_reports_once_with_what_was_held_and_the_fix():
    seen: list[tuple[OutOfMemory, str, int | None]] = []
    limit_mb = anon_bytes() // MIB + 64
    watch = AnonWatch(lambda: ("step", 3), limit_mb, lambda *a: seen.append(a), every_s=0.005)
    watch.start()
    try:
        held = _hold(watch, lambda: bool(seen))
        time.sleep(0.05)  # more samples past the limit: still one report
    finally:
        watch.stop()
    assert len(seen) == 1, seen
    err, phase, step = seen[0]
    assert (phase, step, err.exit_code) == ("step", 3, 13)
    text = str(err)
    assert text.startswith("out of memory: the worker held "), text
    assert f"MiB of anonymous memory, over runtime.worker_memory_limit_mb={limit_mb}; " in text
    assert "a larger runtime.world_size" in text and "a smaller train.micro_batch" in text
    assert watch.peaks["step"] >= (limit_mb + 1) * MIB
    del held


def test_without_a_limit_it_keeps_each_phases_peak_and_reports_nothing():
    phase = ["load"]
    seen: list[object] = []
    watch = AnonWatch(lambda: (phase[0], None), 0, lambda *a: seen.append(a), every_s=0.005)
    watch.start()
    try:
        before = anon_bytes()
        phase[0] = "wrap"
        held = _hold(watch, lambda: watch.peaks.get("wrap", 0) > before + 120 * MIB)
        del held
        phase[0] = "step"
        time.sleep(0.02)
    finally:
        watch.stop()
    peaks = watch.peaks_mib()
    assert list(peaks) == ["load", "wrap", "step"], peaks
    assert peaks["wrap"] > peaks["load"] + 100, peaks  # 128 MiB held in "wrap" alone
    assert not seen


def test_a_negative_limit_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"runtime.worker_memory_limit_mb=-1 is negative; use"):
        load_config(None, ["runtime.worker_memory_limit_mb=-1"])
