"""Early stopping keeps the best epoch's weights on disk, not as a second copy in memory
(enn_core/train/best.py, issue 55)."""

from __future__ import annotations

import pytest
import torch

from enn_core.runtime.memory import host_peak
from tests.fixtures.train import EARLY_STOP, run_local, staged_dir, tiny_cfg

# An ENN of about 25 MB of float32 weights: its weight-sized units stand out of the tiny
# data's activations and of torch's own allocations
WIDE = ["model.d_model=512", "model.heads=2", "model.layers=2", "train.epochs=3"]


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    return staged_dir(tmp_path_factory.mktemp("best"))


def test_training_with_early_stopping_holds_no_second_copy_of_the_weights(staged, tmp_path):
    """Growth over the whole run (the model is built in it): the weights, their gradients
    and AdamW's two moments, 4 units of the weights, plus about 1.6 of activations, the
    optimizer's per-tensor temporaries and torch's own at this size: 5.6 measured. The old
    in-memory snapshot of the best epoch, held while the later epochs train, added one (7.1
    with foreach AdamW's whole-update temporary as well, 6.1 without the snapshot alone)."""
    cfg = tiny_cfg(*WIDE, "train.patience=2")
    out: dict = {}

    def run() -> None:
        out["result"], out["rt"] = run_local(cfg, staged, tmp_path)

    reading = host_peak(run)
    rt = out["rt"]
    weights = sum(p.numel() * p.element_size() for p in rt.model.parameters())
    assert weights > 20 * 2**20
    units = reading.bytes / weights
    assert units < 6.1, f"training grew {units:.2f}x the weights ({reading.how})"
    kept = tmp_path / "best-weights"
    assert not kept.exists() or not any(kept.iterdir())  # removed once restored
    assert torch.isfinite(torch.cat([p.detach().flatten() for p in rt.model.parameters()])).all()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_the_best_epoch_restored_from_its_checkpoint_or_file_bit_identical(staged, tmp_path):
    """The best epoch is not the last: without a checkpointer its weights come back from the
    rank's file, with one from the best epoch's checkpoint; the same bytes either way, and the
    epoch-by-epoch record shows the restore loaded them."""
    cfg = tiny_cfg(*EARLY_STOP)
    plain, rt_plain = run_local(cfg, staged, tmp_path / "plain")
    ckpt, rt_ckpt = run_local(cfg, staged, tmp_path / "ckpt", checkpoints=tmp_path / "dcp")
    assert plain.step_losses == ckpt.step_losses
    assert plain.best_epoch == ckpt.best_epoch
    assert plain.best_epoch is not None and plain.best_epoch < len(plain.history) - 1
    assert torch.equal(_flat(rt_plain.model), _flat(rt_ckpt.model))
    for run in ("plain", "ckpt"):
        events = (tmp_path / run / "events.jsonl").read_text()
        assert '"restored_best"' in events and '"loaded": true' in events
    assert not any((tmp_path / "plain" / "best-weights").iterdir())  # removed once restored
