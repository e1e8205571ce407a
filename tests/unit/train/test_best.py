"""Early stopping keeps the best epoch's weights on disk, not as a second copy in memory
(enn_core/train/best.py, issue 55)."""

from __future__ import annotations

import pytest
import torch

from enn_core.runtime.memory import host_peak
from tests.fixtures.train import run_local, staged_dir, tiny_cfg

# An ENN of about 25 MB of float32 weights: its weight-sized units stand out of the tiny
# data's activations and of torch's own allocations
WIDE = ["model.d_model=512", "model.heads=2", "model.layers=2", "train.epochs=3"]


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    return staged_dir(tmp_path_factory.mktemp("best"))


def test_training_with_early_stopping_holds_no_second_copy_of_the_weights(staged, tmp_path):
    """Growth over the whole run (the model is built in it): the weights, their gradients,
    AdamW's two moments and its one update temporary, 5 units of the weights, plus about one
    more of activations and torch's own at this size: 6.1 measured. The old in-memory
    snapshot of the best epoch, held while the later epochs train, made it 7.1."""
    cfg = tiny_cfg(*WIDE, "train.patience=2")
    out: dict = {}

    def run() -> None:
        out["result"], out["rt"] = run_local(cfg, staged, tmp_path)

    reading = host_peak(run)
    rt = out["rt"]
    weights = sum(p.numel() * p.element_size() for p in rt.model.parameters())
    assert weights > 20 * 2**20
    units = reading.bytes / weights
    assert units < 6.6, f"training grew {units:.2f}x the weights ({reading.how})"
    kept = tmp_path / "best-weights"
    assert not kept.exists() or not any(kept.iterdir())  # removed once restored
    assert torch.isfinite(torch.cat([p.detach().flatten() for p in rt.model.parameters()])).all()
