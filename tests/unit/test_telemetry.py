"""Telemetry's verdict rules: the time shares decide (data-bound, communication-bound,
compute-bound), GPU evidence (given as NVML would report it) gives throttled and starved
verdicts; without pynvml the GPU path is skipped cleanly; the epoch record reaches the
events log (what the task layer forwards to MLflow). The real training loop feeding these
rules is tested in tests/unit/train/test_loop_telemetry.py (world size 1) and
tests/distributed/test_comm_telemetry.py (FSDP2 on 2 workers)."""

from __future__ import annotations

import importlib.util

import pytest

from enn_core.events import EventLog, read_events
from enn_core.telemetry import (
    GpuSampler,
    bottleneck_verdict,
    markdown_table,
    memory_snapshot,
    read_verdicts,
    verdict_from_stats,
    write_epoch,
)

# Epoch sums as the training loop keeps them (enn_core.train.state.EpochStats.as_record()).
STARVED = {"data_s": 2.0, "compute_s": 0.1, "optim_s": 0.02, "comm_s": 0.0, "ckpt_s": 0.0}
FAST = {"data_s": 0.01, "compute_s": 1.0, "optim_s": 0.2, "comm_s": 0.0, "ckpt_s": 0.0}


def test_data_wait_share_makes_it_data_bound():
    verdict = verdict_from_stats(STARVED)
    assert verdict.bottleneck == "data-bound", verdict
    assert verdict.shares["data"] > 0.8
    assert "waiting for batches" in verdict.reason and "shuffle_block" in verdict.reason


def test_compute_share_makes_it_compute_bound():
    verdict = verdict_from_stats(FAST)
    assert verdict.bottleneck == "compute-bound", verdict
    # no communication at all (world size 1): the share is left out, not shown as 0
    assert "communication" not in verdict.shares and "checkpoint" not in verdict.shares


def test_communication_share_makes_it_communication_bound():
    v = bottleneck_verdict({"data": 0.1, "compute": 1.0, "optimizer": 0.1, "communication": 1.5})
    assert v.bottleneck == "communication-bound" and "in collectives" in v.reason
    stats = dict(FAST, comm_s=1.0, ckpt_s=0.3)  # the loop's sums: every phase counts
    v = verdict_from_stats(stats)
    assert v.bottleneck == "communication-bound"
    assert v.shares["communication"] == pytest.approx(1.0 / 2.51)
    assert v.shares["checkpoint"] == pytest.approx(0.3 / 2.51)
    below = verdict_from_stats(dict(FAST, comm_s=0.3))
    assert below.bottleneck == "compute-bound" and below.shares["communication"] < 0.3


def test_hot_gpu_is_throttled_even_at_full_utilization():
    gpu = {
        "util_pct": 100.0,
        "power_w": 650.0,
        "power_limit_w": 700.0,
        "temp_c": 86.0,
        "sm_clock_mhz": 1200.0,
        "sm_clock_max_mhz": 1980.0,
        "throttle": [],
    }
    v = bottleneck_verdict({"data": 0.0, "compute": 1.0, "optimizer": 0.1}, gpu)
    assert v.bottleneck == "throttled" and "86 C" in v.reason
    clocked = dict(gpu, temp_c=70.0, throttle=["hw_power_brake"])
    assert bottleneck_verdict({"compute": 1.0}, clocked).bottleneck == "throttled"


def test_low_utilization_and_power_is_starvation():
    gpu = {
        "util_pct": 60.0,
        "power_w": 250.0,
        "power_limit_w": 700.0,
        "temp_c": 55.0,
        "throttle": [],
    }
    v = bottleneck_verdict({"data": 0.2, "compute": 1.0, "optimizer": 0.1}, gpu)
    assert v.bottleneck == "data-bound" and "60%" in v.reason and "starved" in v.reason
    busy = dict(gpu, util_pct=99.0, power_w=690.0)
    assert bottleneck_verdict({"data": 0.2, "compute": 1.0}, busy).bottleneck == "compute-bound"


@pytest.mark.skipif(
    importlib.util.find_spec("pynvml") is not None, reason="checks the path without pynvml"
)
def test_gpu_sampler_without_pynvml_is_skipped_cleanly():
    sampler = GpuSampler("cuda:0").start()
    assert not sampler.available and "pynvml is not installed" in sampler.reason
    assert sampler.stop() is None


def test_cpu_gpu_sampler_says_why_it_samples_nothing():
    sampler = GpuSampler("cpu").start()
    assert not sampler.available and "device is cpu" in sampler.reason
    assert sampler.stop() is None


def test_memory_snapshot():
    mem = memory_snapshot("cpu")
    assert mem["rss_mib"] > 50 and "cuda_allocated_mib" not in mem
    assert 0 < mem["rss_anon_mib"] <= mem["rss_mib"]


def test_epoch_verdict_reaches_the_events_log(tmp_path):
    verdict = verdict_from_stats(STARVED)
    events = EventLog(tmp_path)
    write_epoch(events, 0, verdict, {"memory": memory_snapshot("cpu"), "samples_per_s": 120.0})
    recs = list(read_events(tmp_path))
    names = {r["name"] for r in recs if r["type"] == "metric"}
    assert {
        "telemetry/bottleneck/data_share",
        "telemetry/bottleneck/code",
        "telemetry/memory/rss_mib",
        "telemetry/throughput/samples_per_s",
    } <= names
    verdicts = read_verdicts(recs)
    assert verdicts[0]["verdict"] == "data-bound" and verdicts[0]["epoch"] == 0
    table = markdown_table(verdicts)
    assert "| 0 | data-bound |" in table
