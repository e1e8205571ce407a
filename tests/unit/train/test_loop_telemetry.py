"""The training loop's telemetry at world size 1: each epoch's bottleneck verdict comes from
the loop's own timings (a starved loader makes it data-bound, the same loop at full speed is
compute-bound), checkpoint time is counted, and with no collectives there is no
communication share. FSDP2's collectives on 2 workers: tests/distributed/test_comm_telemetry.py.
"""

from __future__ import annotations

import time

import pytest

import enn_core.train.step as step_module
from enn_core.events import read_events
from enn_core.telemetry import BOUND_SHARE, read_verdicts
from tests.fixtures.train import run_local, tiny_cfg

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def starve(monkeypatch: pytest.MonkeyPatch, factor: float) -> None:
    """The batch loader sleeps `factor` x the time since its previous call (the step)."""
    load, last = step_module.micro_batches, [time.perf_counter()]

    def slow(*args, **kwargs):
        time.sleep(factor * (time.perf_counter() - last[0]))
        out = load(*args, **kwargs)
        last[0] = time.perf_counter()
        return out

    monkeypatch.setattr(step_module, "micro_batches", slow)


def test_a_starved_loader_is_data_bound_and_full_speed_is_compute_bound(
    staged, tmp_path, monkeypatch
):
    cfg = tiny_cfg("train.epochs=1")
    fast, _ = run_local(cfg, staged, tmp_path / "fast")
    starve(monkeypatch, 5.0)
    slow, _ = run_local(cfg, staged, tmp_path / "slow")
    assert slow.step_losses == fast.step_losses  # only the timing differs
    (got,) = read_verdicts(read_events(tmp_path / "slow"))
    assert got["verdict"] == "data-bound" and got["shares"]["data"] >= BOUND_SHARE, got
    assert slow.history[0]["bottleneck"] == "data-bound"
    assert slow.history[0]["data_wait_share"] >= BOUND_SHARE
    (healthy,) = read_verdicts(read_events(tmp_path / "fast"))
    assert healthy["verdict"] == "compute-bound", healthy
    assert fast.history[0]["bottleneck"] == "compute-bound"


def test_checkpoint_time_is_counted_and_world_size_1_has_no_communication(staged, tmp_path):
    cfg = tiny_cfg("checkpoint.every_steps=2")
    result, _ = run_local(cfg, staged, tmp_path / "run", checkpoints=tmp_path / "ckpt")
    verdicts = read_verdicts(read_events(tmp_path / "run"))
    # epoch 0: its saves at steps 2 and 4; epoch 1: the end-of-epoch-0 save and step 6's, 8's
    for v, row in zip(verdicts, result.history, strict=True):
        assert v["shares"]["checkpoint"] > 0 and row["checkpoint_s"] > 0, v
        assert "communication" not in v["shares"] and row["comm_share"] == 0.0
    names = {r["name"] for r in read_events(tmp_path / "run") if r["type"] == "metric"}
    assert {
        "telemetry/time/communication_s",
        "telemetry/epoch/comm_share",
        "telemetry/epoch/checkpoint_s",
    } <= names
