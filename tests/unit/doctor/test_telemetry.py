"""Telemetry: a real training loop starved by a slow loader is data-bound, the same loop with
a fast loader is compute-bound; GPU evidence (given as NVML would report it) gives throttled
and starved verdicts; without pynvml the GPU path is skipped cleanly; the epoch record reaches
the events log (what the task layer forwards to MLflow)."""

from __future__ import annotations

import importlib.util
import time

import numpy as np
import pytest
import torch

from enn_core.events import EventLog, read_events
from enn_core.telemetry import (
    EpochTelemetry,
    GpuSampler,
    StepTiming,
    bottleneck_verdict,
    markdown_table,
    memory_snapshot,
    read_verdicts,
    step_metrics,
    verdict_from_stats,
    write_epoch,
)


def _loop(steps: int, loader_delay_factor: float) -> tuple[EpochTelemetry, list[StepTiming]]:
    """A tiny real training loop; the loader sleeps `factor` x the previous step's compute."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x_all = np.random.default_rng(0).normal(size=(steps * 64, 32)).astype(np.float32)
    tel, timings, last_compute = EpochTelemetry("cpu"), [], 0.0
    for s in range(steps):
        t0 = time.perf_counter()
        if loader_delay_factor:
            time.sleep(loader_delay_factor * max(last_compute, 1e-3))
        x = torch.from_numpy(x_all[s * 64 : (s + 1) * 64].copy())
        t1 = time.perf_counter()
        loss = net(x).square().mean()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        last_compute = t2 - t1
        timing = StepTiming(data_s=t1 - t0, compute_s=t2 - t1, optimizer_s=t3 - t2, samples=64)
        tel.add(timing)
        timings.append(timing)
    return tel, timings


def test_starved_loader_is_data_bound():
    tel, _ = _loop(steps=6, loader_delay_factor=20.0)
    verdict, record = tel.end_epoch()
    assert verdict.bottleneck == "data-bound", verdict
    assert verdict.shares["data"] > 0.8
    assert "waiting for batches" in verdict.reason and "shuffle_block" in verdict.reason
    assert record["samples"] == 6 * 64 and record["samples_per_s"] > 0
    assert record["gpu"] is None and "device is cpu" in record["gpu_note"]


def test_fast_loader_is_compute_bound():
    tel, timings = _loop(steps=20, loader_delay_factor=0.0)
    verdict, _ = tel.end_epoch()
    assert verdict.bottleneck == "compute-bound", verdict
    # the trainer's own epoch sums give the same verdict
    stats = {
        "data_s": sum(t.data_s for t in timings),
        "compute_s": sum(t.compute_s for t in timings),
        "optim_s": sum(t.optimizer_s for t in timings),
    }
    assert verdict_from_stats(stats).bottleneck == "compute-bound"


def test_communication_share_makes_it_communication_bound():
    v = bottleneck_verdict({"data": 0.1, "compute": 1.0, "optimizer": 0.1, "communication": 1.5})
    assert v.bottleneck == "communication-bound" and "in collectives" in v.reason


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


def test_memory_and_step_records():
    mem = memory_snapshot("cpu")
    assert mem["rss_mib"] > 50 and "cuda_allocated_mib" not in mem
    metrics = step_metrics(StepTiming(data_s=0.1, compute_s=0.3, optimizer_s=0.1, samples=50), mem)
    assert metrics["time/step_s"] == pytest.approx(0.5)
    assert metrics["throughput/samples_per_s"] == pytest.approx(100.0)
    assert metrics["memory/rss_mib"] == mem["rss_mib"]


def test_epoch_verdict_reaches_the_events_log(tmp_path):
    tel, _ = _loop(steps=3, loader_delay_factor=20.0)
    verdict, record = tel.end_epoch()
    events = EventLog(tmp_path)
    write_epoch(events, 0, verdict, record)
    recs = list(read_events(tmp_path))
    names = {r["name"] for r in recs if r["type"] == "metric"}
    assert {
        "bottleneck/data_share",
        "bottleneck/code",
        "memory/rss_mib",
        "throughput/samples_per_s",
    } <= names
    verdicts = read_verdicts(recs)
    assert verdicts[0]["verdict"] == "data-bound" and verdicts[0]["epoch"] == 0
    table = markdown_table(verdicts)
    assert "| 0 | data-bound |" in table
