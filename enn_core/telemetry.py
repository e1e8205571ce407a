"""Telemetry during training and prediction: memory and GPU snapshots, and the per-epoch
bottleneck verdict (data-bound, compute-bound, communication-bound, throttled).

    verdict = verdict_from_stats(epoch_stats, gpu)   # the loop's epoch sums (train/state.py)
    write_epoch(events, epoch, verdict, record)      # metrics + a "bottleneck" event (-> MLflow)

The training loop sums, per epoch, the seconds of data wait, compute, optimizer,
communication (time blocked in collectives: FSDP2's all-gathers and reduce-scatters and the
loop's all-reduces, enn_core.runtime.comm_clock) and checkpointing; `verdict_from_stats`
turns those sums into the verdict; `GpuSampler` adds NVML evidence on GPUs.

Rules (seed 04's thresholds where they apply): the time shares of a step decide first; a
share of data wait (or communication) >= BOUND_SHARE means the accelerator waits for it that
fraction of the time. On GPUs, NVML adds evidence: temperature over 80 C or a thermal /
power-brake clock event -> throttled (utilization stays high while the run slows); utilization
under 95% with power far under its limit (< 50%) -> starved, attributed to the larger of data
wait and communication. NVML is read through pynvml only when it is importable; without it
the GPU fields are absent and the verdict rests on the time shares.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from enn_core.events import EventLog
from enn_core.metric_names import telemetry

if TYPE_CHECKING:  # torch is imported where a device is read: the diagnostics record reads
    import torch  # this module's verdicts in stages that never load torch (stage-data: ~1.5 s)

BOUND_SHARE = 0.3  # data wait or communication share of step time that makes a run "bound"
UTIL_MIN_PCT = 95.0  # seed 04: sustained GPU utilization below this -> data/communication bound
POWER_FRACTION_MIN = 0.5  # power draw far under its limit -> GPU starvation
TEMP_MAX_C = 80.0  # seed 04: thermal throttling starts above this
# NVML clock event reasons (nvmlClocksEventReason*): the ones that mean the GPU slowed itself.
THROTTLE_BITS = {0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}
VERDICTS = ("data-bound", "compute-bound", "communication-bound", "throttled")


def _status_kb(field_name: str) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return float(line.split()[1])
    return None


def memory_snapshot(device: torch.device | str | None = None) -> dict[str, float]:
    """Process RSS and anonymous RSS (MiB); CUDA allocated, reserved and peak when on CUDA.

    Anonymous memory is what grows with leaks and copies; RSS also counts memmap pages read."""
    mib = 2**20
    out = {"rss_mib": psutil.Process().memory_info().rss / mib}
    anon = _status_kb("RssAnon")
    if anon is not None:
        out["rss_anon_mib"] = anon / 1024
    import torch

    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        out["cuda_allocated_mib"] = torch.cuda.memory_allocated(dev) / mib
        out["cuda_reserved_mib"] = torch.cuda.memory_reserved(dev) / mib
        out["cuda_peak_mib"] = torch.cuda.max_memory_allocated(dev) / mib
    return out


def nvml_module() -> tuple[Any, str]:
    """(pynvml initialised, '') or (None, why not): NVML is optional and never required."""
    try:
        import pynvml
    except ImportError:
        return (
            None,
            "pynvml is not installed "
            "(pip install nvidia-ml-py for GPU utilization, power, temperature)",
        )
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - pynvml.NVMLError and driver load errors alike
        return None, f"NVML unavailable ({type(e).__name__}: {e})"
    return pynvml, ""


def gpu_snapshot(nvml: Any, index: int) -> dict[str, Any]:
    """Utilization, power, limit, temperature, SM clocks and throttle reasons of one GPU."""
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    reasons_fn = (
        getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    )
    bits = int(reasons_fn(h))
    return {
        "util_pct": float(nvml.nvmlDeviceGetUtilizationRates(h).gpu),
        "power_w": nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
        "power_limit_w": nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
        "temp_c": float(nvml.nvmlDeviceGetTemperature(h, 0)),  # 0 = NVML_TEMPERATURE_GPU
        "sm_clock_mhz": float(nvml.nvmlDeviceGetClockInfo(h, 1)),  # 1 = NVML_CLOCK_SM
        "sm_clock_max_mhz": float(nvml.nvmlDeviceGetMaxClockInfo(h, 1)),
        "throttle": [name for bit, name in THROTTLE_BITS.items() if bits & bit],
    }


class GpuSampler:
    """Samples one GPU every `interval` seconds in a daemon thread (as nvidia-smi would)."""

    def __init__(self, device: torch.device | str, interval: float = 0.5) -> None:
        import torch

        dev = torch.device(device)
        self.index = dev.index or 0
        self.interval = interval
        self.samples: list[dict[str, Any]] = []
        self.nvml: Any
        self.reason: str
        self.nvml, self.reason = (
            (None, f"device is {dev.type}") if dev.type != "cuda" else nvml_module()
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self.nvml is not None

    def start(self) -> GpuSampler:
        if self.available and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="enn-gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            self.samples.append(gpu_snapshot(self.nvml, self.index))
            if self._stop.wait(self.interval):
                return

    def stop(self) -> dict[str, Any] | None:
        """Summary of the samples since start (None without NVML); clears them."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(2 * self.interval + 1)
            self._thread = None
        samples, self.samples = self.samples, []
        return summarize_gpu(samples) if samples else None


def summarize_gpu(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    def mean(k: str) -> float:
        return sum(float(s[k]) for s in samples) / len(samples)

    return {
        "util_pct": mean("util_pct"),
        "util_min_pct": min(float(s["util_pct"]) for s in samples),
        "power_w": mean("power_w"),
        "power_limit_w": max(float(s["power_limit_w"]) for s in samples),
        "temp_c": max(float(s["temp_c"]) for s in samples),
        "sm_clock_mhz": mean("sm_clock_mhz"),
        "sm_clock_max_mhz": max(float(s["sm_clock_max_mhz"]) for s in samples),
        "throttle": sorted({r for s in samples for r in s.get("throttle", [])}),
        "samples": len(samples),
    }


@dataclass(frozen=True)
class Verdict:
    bottleneck: str  # one of VERDICTS
    reason: str
    shares: dict[str, float]
    gpu: dict[str, Any] | None = None

    def as_record(self) -> dict[str, Any]:
        return asdict(self)

    def as_metrics(self) -> dict[str, float]:
        out = {telemetry(f"bottleneck/{k}_share"): v for k, v in self.shares.items()}
        out[telemetry("bottleneck/code")] = float(VERDICTS.index(self.bottleneck))
        for k in ("util_pct", "power_w", "power_limit_w", "temp_c", "sm_clock_mhz"):
            if self.gpu and self.gpu.get(k) is not None:
                out[telemetry(f"gpu/{k}")] = float(self.gpu[k])
        return out


def shares_of(times: Mapping[str, float], wall_s: float | None = None) -> dict[str, float]:
    """Each phase's fraction of the wall time (default: the sum of the phases)."""
    total = wall_s if wall_s and wall_s > 0 else sum(times.values())
    if total <= 0:
        return {k: 0.0 for k in times}
    return {k: max(0.0, v) / total for k, v in times.items()}


def bottleneck_verdict(
    times: Mapping[str, float], gpu: Mapping[str, Any] | None = None, wall_s: float | None = None
) -> Verdict:
    """The epoch's verdict from phase times {data, compute, optimizer, communication, ...}."""
    shares = shares_of(times, wall_s)
    data, comm = shares.get("data", 0.0), shares.get("communication", 0.0)
    pct = ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items())
    if gpu:
        throttle = [
            r
            for r in gpu.get("throttle", [])
            if "thermal" in r or "power_brake" in r or r == "hw_slowdown"
        ]
        if float(gpu.get("temp_c", 0.0)) > TEMP_MAX_C or throttle:
            return Verdict(
                "throttled",
                f"GPU at {gpu.get('temp_c', 0):.0f} C (> {TEMP_MAX_C:.0f} C throttles) "
                f"{'clock events ' + ','.join(throttle) if throttle else ''}; SM clock "
                f"{gpu.get('sm_clock_mhz', 0):.0f}/{gpu.get('sm_clock_max_mhz', 0):.0f} MHz; "
                f"{pct}: check cooling and power capping",
                shares,
                dict(gpu),
            )
    if max(data, comm) >= BOUND_SHARE:
        kind = "data-bound" if data >= comm else "communication-bound"
        what = "waiting for batches" if kind == "data-bound" else "in collectives"
        fix = (
            "read larger contiguous blocks (train.shuffle_block), stage data onto local disk, "
            "add prefetch"
            if kind == "data-bound"
            else "fewer or larger collectives, a faster interconnect, HSDP across nodes"
        )
        return Verdict(
            kind,
            f"{100 * max(data, comm):.0f}% of step time {what} "
            f"(>= {100 * BOUND_SHARE:.0f}%); {pct}: {fix}",
            shares,
            dict(gpu) if gpu else None,
        )
    if gpu and float(gpu.get("util_pct", 100.0)) < UTIL_MIN_PCT:
        limit = float(gpu.get("power_limit_w") or 0.0)
        starved = limit > 0 and float(gpu.get("power_w", 0.0)) < POWER_FRACTION_MIN * limit
        if starved and max(data, comm) > 0.1:
            kind = "data-bound" if data >= comm else "communication-bound"
            return Verdict(
                kind,
                f"GPU utilization {gpu['util_pct']:.0f}% (< {UTIL_MIN_PCT:.0f}%) and power "
                f"{gpu['power_w']:.0f}/{limit:.0f} W: starved; {pct}",
                shares,
                dict(gpu),
            )
        return Verdict(
            "compute-bound",
            f"GPU utilization {gpu['util_pct']:.0f}% (< {UTIL_MIN_PCT:.0f}%) with small "
            f"data and communication shares: launch/Python overhead of small kernels; {pct}: "
            "a larger batch or train.compile=true",
            shares,
            dict(gpu),
        )
    return Verdict(
        "compute-bound",
        f"forward/backward and optimizer dominate; {pct}",
        shares,
        dict(gpu) if gpu else None,
    )


def verdict_from_stats(stats: Mapping[str, float], gpu: Mapping[str, Any] | None = None) -> Verdict:
    """The verdict from the trainer's epoch sums: data_s, compute_s, optim_s and, when not
    zero, comm_s and ckpt_s (enn_core.train.state.EpochStats)."""
    times = {
        "data": stats.get("data_s", 0.0),
        "compute": stats.get("compute_s", 0.0),
        "optimizer": stats.get("optim_s", 0.0),
    }
    for key, name in (("comm_s", "communication"), ("ckpt_s", "checkpoint")):
        if stats.get(key):
            times[name] = stats[key]
    return bottleneck_verdict(times, gpu)


def write_epoch(
    events: EventLog, epoch: int, verdict: Verdict, record: Mapping[str, Any] | None = None
) -> None:
    """Metrics (shares, memory, GPU) at step=epoch and one `bottleneck` event (-> MLflow)."""
    metrics = verdict.as_metrics()
    for k, v in ((record or {}).get("memory") or {}).items():
        metrics[telemetry(f"memory/{k}")] = float(v)
    if record and record.get("samples_per_s"):
        metrics[telemetry("throughput/samples_per_s")] = float(record["samples_per_s"])
    events.metrics(metrics, step=epoch)
    events.event(
        "bottleneck",
        epoch=epoch,
        verdict=verdict.bottleneck,
        reason=verdict.reason,
        shares=verdict.shares,
        gpu=verdict.gpu,
    )


def read_verdicts(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The `bottleneck` events of an events stream (enn_core.events.read_events(run_dir))."""
    return [
        dict(r["fields"])
        for r in records
        if r.get("type") == "event" and r.get("name") == "bottleneck"
    ]


def markdown_table(verdicts: list[Mapping[str, Any]]) -> str:
    """A table for a Prefect markdown artifact: epoch, verdict, shares, reason."""
    lines = [
        "| epoch | verdict | data | compute | optimizer | communication | reason |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for v in verdicts:
        s = v.get("shares", {})
        cells = [
            f"{100 * s.get(k, 0.0):.0f}%" for k in ("data", "compute", "optimizer", "communication")
        ]
        reason = str(v.get("reason", "")).replace("|", "/")
        lines.append(f"| {v.get('epoch')} | {v.get('verdict')} | {' | '.join(cells)} | {reason} |")
    return "\n".join(lines)
