"""The cores a job's workers share are this process's (its affinity: a taskset, a cgroup's
cpuset, a SLURM allocation), not the machine's: training and prediction both split them."""

from __future__ import annotations

import os

import pytest

from enn_core.config import load_config
from enn_core.predict.stage import _threads
from enn_core.runtime.device import threads_per_worker, usable_cores

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs an affinity to narrow (Linux, two cores)",
)


@pytest.fixture
def one_core():
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def test_a_narrowed_affinity_is_what_the_workers_share(one_core):
    assert usable_cores() == 1 < (os.cpu_count() or 1)
    assert threads_per_worker(0, world_size=1) == 1  # training's worker
    assert _threads(load_config(None, []), 1) == 1  # prediction's: it counted the machine's
    assert threads_per_worker(3, world_size=1) == 3  # a configured count stays
