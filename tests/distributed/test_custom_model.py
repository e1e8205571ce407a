"""Your own nn.Module under the runtime's failure handling: the example temporal convolution
(examples/tcn, `model.preset: custom`) on two FSDP2 workers resumes from its DCP checkpoint
at the exact step, bit-identical to an uninterrupted run, and backs its micro-batch off
after an OOM on one rank, as the presets do."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from enn_core.data.dataset import StagedDataset
from enn_core.stages import STAGE_DATA
from enn_core.train.ckpt import committed
from enn_core.train.fingerprint import fingerprint
from tests.fixtures.distributed import cfg_of, make_project, outputs, run_train

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
CUSTOM = (
    "model.preset=custom",
    "model.factory=examples.tcn.model:build",
    "model.options={channels: 8, layers: 2}",
)
# 2 epochs of 9 steps (batch 4 over the tiny split), a checkpoint every 3 steps.
BASE = (
    *CUSTOM,
    "train.epochs=2",
    "train.batch_size=4",
    "train.patience=0",
    "checkpoint.every_steps=3",
)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A tiny project whose root holds the example's code (the factory is imported from it)."""
    root = tmp_path_factory.mktemp("custom") / "proj"
    shutil.copytree(ROOT / "examples", root / "examples", ignore=shutil.ignore_patterns("__py*"))
    return make_project(root, *CUSTOM)


def test_resumes_at_the_exact_step_bit_identical(project):
    summary, _ = run_train(project, cfg_of(*BASE))
    assert summary["wrap"] == "fsdp2" and summary["world_size"] == 2, summary
    _, ref = outputs(project)
    assert any(k.startswith("body.blocks.") for k in ref), sorted(ref)  # the module's weights
    with pytest.raises(Exception, match="injected fault"):
        fault = ("fault.kind=raise", "fault.phase=step", "fault.step=7", "fault.rank=-1")
        run_train(project, cfg_of(*BASE, *fault))
    staged = StagedDataset(STAGE_DATA.output_dir(project)).fingerprint
    root = project.checkpoints / fingerprint(cfg_of(*BASE), staged).digest
    assert [p.name for p in committed(root)][-1] == "step-00000006"
    summary, _ = run_train(project, cfg_of(*BASE))
    assert summary["checkpoint"]["resumed_from"].endswith("step-00000006"), summary
    history, state = outputs(project)
    assert len(history["step_losses"]) == 18  # every step once
    assert state.keys() == ref.keys()
    for k in ref:
        assert torch.equal(state[k], ref[k]), f"{k} differs after resume"


def test_an_oom_on_one_rank_halves_every_ranks_micro_batch(project):
    oom = ("fault.kind=oom", "fault.phase=step", "fault.step=2", "fault.rank=1")
    summary, _ = run_train(project, cfg_of(*CUSTOM, *oom))
    r0, r1 = summary["ranks"][0], summary["ranks"][1]
    assert r0["oom_backoffs"] == r1["oom_backoffs"] == 1, summary["ranks"]
    assert r0["micro_batch"] == r1["micro_batch"] == 2, summary["ranks"]
    assert r0["step_losses_sha"] == r1["step_losses_sha"]
