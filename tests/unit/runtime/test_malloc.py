"""runtime.malloc_mmap_threshold_mb (enn_core.runtime.malloc): with glibc's threshold fixed, a
freed block of a few MiB goes back to the system; with glibc's moving one it stays resident,
a hole in the heap that a worker's next peak counts. Each case in a fresh interpreter (the
threshold is the process's)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from enn_core.config import load_config
from enn_core.errors import ConfigError

PROBE = """
import sys
import numpy as np
from enn_core.runtime.malloc import set_mmap_threshold
from enn_core.runtime.memory import anon_bytes

set_mmap_threshold(int(sys.argv[1]))
a = np.ones(8 << 17)  # 8 MiB, mapped; freeing it moves glibc's own threshold past 8 MiB
del a
b = np.ones(8 << 17)  # 8 MiB: from the heap under the moved threshold, mapped under 4 MiB
c = np.ones(1 << 13)  # 64 KiB after it, so the heap's top cannot be trimmed away
before = anon_bytes()
del b
print((before - anon_bytes()) / (1 << 20))
"""


def _freed_mib(*thresholds_mb: int) -> list[float]:
    """MiB handed back by freeing the 8 MiB block, under each threshold (run side by side)."""
    probes = [
        subprocess.Popen([sys.executable, "-c", PROBE, str(mb)], stdout=subprocess.PIPE, text=True)
        for mb in thresholds_mb
    ]
    out = [p.communicate(timeout=60)[0] for p in probes]
    assert [p.returncode for p in probes] == [0] * len(probes), out
    return [float(o.strip()) for o in out]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_fixed_threshold_hands_a_freed_block_back_and_glibcs_own_keeps_it():
    fixed, glibcs = _freed_mib(4, 0)
    assert fixed > 7.5  # the default: the 8 MiB went back to the system
    assert glibcs < 0.5  # glibc's moving threshold: still resident, in the heap


def test_the_threshold_is_checked_with_the_fix():
    assert load_config(None, []).runtime.malloc_mmap_threshold_mb == 4
    for bad in ("-1", "33"):
        with pytest.raises(ConfigError, match=r"use MiB from 1 to 32 \(4\), or 0 for glibc's own"):
            load_config(None, [f"runtime.malloc_mmap_threshold_mb={bad}"])
