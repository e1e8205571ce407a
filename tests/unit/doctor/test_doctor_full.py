"""The whole doctor on a CUDA machine: the NCCL lane, bf16 and CUDA memory telemetry (on
staged data through main(), quick: tests/distributed/test_doctor.py)."""

from __future__ import annotations

import time

import pytest
import torch

from enn_core.doctor import run_doctor
from enn_core.telemetry import GpuSampler, memory_snapshot
from tests.fixtures.doctor import make_config


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_doctor_on_cuda(layout):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    report = run_doctor(
        make_config("runtime.device=cuda"),
        layout,
        quick=True,
        only=["precision", "workers", "distributed"],
    )
    assert report.exit_code == 0, report.table()
    assert report.find("workers")[0].data["lanes"] == ["gloo", "nccl"]
    assert "nccl" in report.find("distributed", "backend")[0].detail
    mem = memory_snapshot("cuda:0")
    assert {"cuda_allocated_mib", "cuda_reserved_mib", "cuda_peak_mib"} <= set(mem)
    sampler = GpuSampler("cuda:0", interval=0.1).start()
    torch.cuda.synchronize()
    time.sleep(0.5)  # let it take a few samples
    summary = sampler.stop()
    assert (summary is None) == (not sampler.available)
    if summary is not None:
        assert 0 <= summary["util_pct"] <= 100 and summary["power_limit_w"] > 0
