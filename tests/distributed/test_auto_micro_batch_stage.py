"""`train.micro_batch: auto` through the distributed-train stage: the worker probes memory,
the ranks agree, and the choice and its reason reach the run record."""

from __future__ import annotations

import pytest

from enn_core.events import read_events
from tests.fixtures.distributed import cfg_of, run_train

pytestmark = pytest.mark.timeout(240)


def test_auto_micro_batch_is_probed_agreed_and_recorded(tiny_project):
    summary, run_dir = run_train(tiny_project, cfg_of("train.micro_batch=auto", "train.epochs=1"))
    per_rank = 8 // 2
    assert per_rank % summary["micro_batch"] == 0
    assert summary["accumulation"] == per_rank // summary["micro_batch"]
    params = {e["name"]: e["value"] for e in read_events(run_dir) if e.get("type") == "param"}
    assert params["resolved.train.micro_batch"] == summary["micro_batch"]
    assert params.get("resolved.runtime.micro_batch_reason")
    ranks = summary["ranks"]
    assert ranks[0]["micro_batch"] == ranks[1]["micro_batch"]
