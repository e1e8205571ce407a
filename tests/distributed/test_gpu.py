"""The NCCL path (`cuda:nccl,cpu:gloo`) with one worker per GPU; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.distributed import cfg_of, outputs, run_train

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
def test_nccl_one_worker_per_gpu(tiny_project):
    summary, _ = run_train(
        tiny_project, cfg_of("runtime.world_size=0", "runtime.device=cuda", "train.precision=auto")
    )
    assert summary["world_size"] == GPUS and summary["applied_steps"] > 0
    history, state = outputs(tiny_project)
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


@pytest.mark.skipif(GPUS < 2, reason="needs at least 2 CUDA devices")
def test_nccl_two_ranks_agree(tiny_project):
    summary, _ = run_train(
        tiny_project, cfg_of("runtime.world_size=2", "runtime.device=cuda", "train.precision=fp32")
    )
    assert summary["wrap"] == "fsdp2"
    assert summary["ranks"][0]["step_losses_sha"] == summary["ranks"][1]["step_losses_sha"]
