"""Benchmark harness: baseline and subject interleaved, median ratio, machine facts.

These machines are noisy and absolute times drift, so every benchmark times a baseline and
its subject in the same process, alternating (B, S, B, S, ...) for at least 5 pairs, and
reports the median of the per-pair ratios baseline_time / subject_time (> 1: subject faster;
for "subject reaches at least 0.9 of baseline throughput", ratio >= 0.9).

    from bench.harness import compare
    compare("stage 1 GB npy vs np.load+np.save", baseline=copy, subject=stage, pairs=5, target=0.5)

Benchmarks are not tests: they print, they never assert.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def machine_facts() -> dict[str, Any]:
    import numpy as np

    facts = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "numpy": np.__version__,
    }
    try:
        import torch

        facts["torch"] = torch.__version__
        facts["torch_threads"] = torch.get_num_threads()
        facts["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        facts["torch"] = None
    try:
        with open("/proc/meminfo") as f:
            facts["mem_total_kb"] = int(f.readline().split()[1])
    except OSError:
        pass
    return facts


def compare(
    name: str,
    baseline: Callable[[], Any],
    subject: Callable[[], Any],
    *,
    pairs: int = 5,
    warmup: int = 1,
    target: float | None = None,
    setup: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Time `baseline` and `subject` interleaved; print and return the median ratio."""
    if pairs < 5:
        raise ValueError("at least 5 interleaved pairs")
    for _ in range(warmup):
        if setup:
            setup()
        baseline()
        if setup:
            setup()
        subject()
    times_b, times_s, ratios = [], [], []
    for i in range(pairs):
        order = (
            (("b", baseline), ("s", subject)) if i % 2 == 0 else (("s", subject), ("b", baseline))
        )
        got = {}
        for key, fn in order:
            if setup:
                setup()
            t0 = time.perf_counter()
            fn()
            got[key] = time.perf_counter() - t0
        times_b.append(got["b"])
        times_s.append(got["s"])
        ratios.append(got["b"] / got["s"])
    result = {
        "benchmark": name,
        "pairs": pairs,
        "baseline_median_s": statistics.median(times_b),
        "subject_median_s": statistics.median(times_s),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "target": target,
        "meets_target": None if target is None else statistics.median(ratios) >= target,
        "machine": machine_facts(),
    }
    print(
        f"{name}: median ratio baseline/subject = {result['ratio_median']:.3f} "
        f"(min {result['ratio_min']:.3f}, max {result['ratio_max']:.3f}, {pairs} pairs)"
        + (
            f"; target >= {target}: {'met' if result['meets_target'] else 'NOT met'}"
            if target
            else ""
        )
    )
    print(json.dumps(result, indent=2), file=sys.stderr)
    return result
