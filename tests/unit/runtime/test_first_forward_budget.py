"""The first training step's watchdog budget grows with the model (issue 55, seed 03's hang):
runtime.hang_timeout_s plus runtime.first_forward_s_per_gb per GB of weights, logged and
recorded with its reason by distributed-train, and the budget the watchdog applies to the
`first_forward` phase: a large model's slow first all-gather is not called hung, a later
step silent as long is, and a first step silent past its own budget is still named, with its
phase."""

from __future__ import annotations

import json
import logging
import time

import pytest

from enn_core.errors import ConfigError
from enn_core.paths import Layout
from enn_core.runtime.launch import Watchdog
from enn_core.runtime.watchdog import FIRST_FORWARD, first_forward_budget
from enn_core.stage import make_context
from enn_core.stages import DISTRIBUTED_TRAIN
from enn_core.train.stage import phase_budgets
from tests.fixtures.train import tiny_cfg
from tests.unit.runtime.test_watchdog import beat


def test_the_budget_is_hang_timeout_plus_seconds_per_gb_of_weights():
    # seed 03's model: 3.37 billion float32 parameters, 13.5 GB
    budget, why = first_forward_budget(120.0, 13_480_000_000, 60.0)
    assert budget == pytest.approx(120 + 13.48 * 60)
    assert why == (
        "runtime.hang_timeout_s=120 + 13.48 GB of weights x runtime.first_forward_s_per_gb=60"
    )
    assert first_forward_budget(120.0, 13_480_000_000, 0.0)[0] == 120.0  # scaling off
    assert first_forward_budget(120.0, 400_000, 60.0)[0] == pytest.approx(120.024)  # tiny
    with pytest.raises(ConfigError, match="first_forward_s_per_gb must be >= 0"):
        tiny_cfg("runtime.first_forward_s_per_gb=-1")


def test_the_watchdog_gives_the_first_step_its_own_budget(tmp_path):
    first, _ = first_forward_budget(10.0, 2_000_000_000, 20.0)  # 10 s + 2 GB x 20 s = 50 s
    w = Watchdog(tmp_path, 2, hang_timeout_s=10.0, budgets={FIRST_FORWARD: first})
    frame = "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:1 in foreach_all_gather"
    for rank in (0, 1):  # both ranks inside the first all-gather for 30 s: still in budget
        beat(tmp_path, rank, age=30, phase=FIRST_FORWARD, in_collective=True, frame=frame)
    assert w.check(time.time()) is None
    for rank in (0, 1):  # the same silence in a later step is a hang
        beat(tmp_path, rank, age=30, phase="step", in_collective=True, frame=frame)
    v = w.check(time.time())
    assert v is not None and v.phase == "step"
    for rank in (0, 1):  # and a first step silent past its own budget is named as one
        beat(tmp_path, rank, age=55, phase=FIRST_FORWARD, in_collective=True, frame=frame)
    v = w.check(time.time())
    assert v is not None and v.phase == FIRST_FORWARD
    assert "hung in phase first_forward step 0 (no progress for 55 s" in v.message(tmp_path)


def test_distributed_train_logs_and_records_the_first_steps_budget(tmp_path, caplog):
    cfg = tiny_cfg("runtime.hang_timeout_s=100", "runtime.first_forward_s_per_gb=50")
    ctx = make_context(cfg, Layout.for_root(tmp_path), DISTRIBUTED_TRAIN, "r")
    with caplog.at_level(logging.INFO):
        budgets = phase_budgets(cfg, ctx, 4_000_000_000)  # a 1B-parameter init.pt
    assert budgets[FIRST_FORWARD] == pytest.approx(300.0)
    assert budgets["checkpoint"] == cfg.runtime.checkpoint_budget_s
    why = "runtime.hang_timeout_s=100 + 4.00 GB of weights x runtime.first_forward_s_per_gb=50"
    assert f"the first step's hang budget is 300 s ({why})" in caplog.text
    events = [json.loads(line) for line in (ctx.run_dir / "events.jsonl").read_text().splitlines()]
    params = {e["name"]: e["value"] for e in events if e.get("type") == "param"}
    assert params["resolved.runtime.first_forward_budget_s"] == 300.0
    assert params["resolved.runtime.first_forward_budget_reason"] == why
    # a small model's first step keeps hang_timeout_s, and adds no line
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert phase_budgets(cfg, ctx, 400_000)[FIRST_FORWARD] == pytest.approx(100.02)
    assert "hang budget" not in caplog.text
