"""Checkpoints of the training state at world size 1 (real DCP saves in one process): what a
checkpoint holds, and that a run interrupted mid-epoch resumes bit-identically, also from a
checkpoint whose partial-epoch statistics predate the communication and checkpoint timings."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from enn_core.errors import UntrustedCheckpointError
from enn_core.events import read_events
from enn_core.train.ckpt import COMMITTED, TRAINER, committed, content_hashes
from tests.fixtures.train import run_local, tiny_cfg, with_fault

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# 2 epochs of 5 steps; a checkpoint every 3 global steps and at epoch ends (3, 5, 6, 9, 10); the
# Student-t loss owns a parameter, so the DCP state holds "loss.*" keys as well.
CKPT = ("checkpoint.every_steps=3", "checkpoint.keep_last=5", "train.loss=student_t")

# trainer.json as written before this format gained anything: its keys are a contract.
TRAINER_KEYS = {
    "format",
    "position",
    "epoch",
    "step",
    "steps_per_epoch",
    "epoch_end",
    "stopped",
    "world_size",
    "attempt",
    "saved_at",
    "scheduler",
    "grad_scaler",
    "best_loss",
    "best_epoch",
    "best_checkpoint",
    "bad_epochs",
    "applied_steps",
    "history",
    "step_losses",
    "epoch_stats",
    "guard",
    "governor",
}
OLD_EPOCH_STATS = {"loss", "weight", "data_s", "compute_s", "optim_s", "skipped", "wall_s"}


def params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def reference(staged, tmp_path_factory):
    """The uninterrupted run, and its checkpoint directory."""
    root = tmp_path_factory.mktemp("ref")
    result, rt = run_local(tiny_cfg(*CKPT), staged, root / "run", checkpoints=root / "ckpt")
    return result, params(rt.model), rt.loss.log_scale.detach().clone(), root / "ckpt"


def test_a_checkpoint_holds_the_model_the_loss_and_the_optimizer(reference):
    *_, ckpt = reference
    saved = committed(ckpt)
    assert [p.name for p in saved] == [f"step-{n:08d}" for n in (3, 5, 6, 9, 10)]
    keys = set(FileSystemReader(str(saved[0])).read_metadata().state_dict_metadata)
    assert {k.split(".")[0] for k in keys} == {"model", "optim"}
    assert "model.loss.log_scale" in keys and any(k.startswith("model.model.") for k in keys)
    mid = json.loads((saved[0] / TRAINER).read_text())
    assert set(mid) == TRAINER_KEYS and mid["position"] == 3 and not mid["epoch_end"]
    assert set(mid["epoch_stats"]) == OLD_EPOCH_STATS | {"comm_s", "ckpt_s"}
    end = json.loads((saved[1] / TRAINER).read_text())
    assert set(end) == TRAINER_KEYS and end["epoch_end"] and end["epoch_stats"] == {}


@pytest.mark.parametrize("written_before_timings", [False, True])
def test_interrupted_mid_epoch_resumes_bit_identical(
    staged, tmp_path, reference, written_before_timings
):
    ref, ref_params, ref_scale, _ = reference
    ckpt = tmp_path / "ckpt"
    crash = with_fault(tiny_cfg(*CKPT), kind="raise", phase="step", step=4)
    with pytest.raises(Exception, match="injected fault"):
        run_local(crash, staged, tmp_path / "crashed", checkpoints=ckpt)
    last = committed(ckpt)[-1]
    assert last.name == "step-00000003"
    if written_before_timings:  # as a checkpoint written before comm_s and ckpt_s existed
        trainer = json.loads((last / TRAINER).read_text())
        trainer["epoch_stats"] = {k: trainer["epoch_stats"][k] for k in OLD_EPOCH_STATS}
        (last / TRAINER).write_text(json.dumps(trainer))
    result, rt = run_local(tiny_cfg(*CKPT), staged, tmp_path / "resumed", checkpoints=ckpt)
    assert result.step_losses == ref.step_losses  # bit-identical, every step once
    assert torch.equal(params(rt.model), ref_params)
    assert torch.equal(rt.loss.log_scale.detach(), ref_scale)
    assert [h["epoch"] for h in result.history] == [0, 1]


def test_an_unreadable_trainer_state_is_named_with_what_to_do(staged, tmp_path, reference):
    """A checkpoint's trainer.json that cannot be read is named, with what to do."""
    *_, ckpt = reference
    broken = Path(tmp_path / "ckpt")
    broken.mkdir()
    for p in committed(ckpt)[:1]:
        dest = broken / p.name
        dest.mkdir()
        for f in p.iterdir():
            (dest / f.name).write_bytes(f.read_bytes())
        (dest / TRAINER).write_text("{not json")
        # Its COMMITTED hashes match the broken file (written so, not corrupted on disk later):
        # no quarantine, the unreadable state itself is reported.
        record = json.loads((dest / COMMITTED).read_text())
        record["files"] = content_hashes(dest)
        (dest / COMMITTED).write_text(json.dumps(record))
    with pytest.raises(Exception, match=r"unreadable checkpoint state .* delete .* to fall back"):
        run_local(tiny_cfg(*CKPT), staged, tmp_path / "run", checkpoints=broken)


# -- crafted files (issue 16): refused in one line naming the file, and nothing in them runs --


class Payload:
    """An attacker's object: unpickling it runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _copy_first(reference, dest: Path) -> Path:
    """The reference run's first committed checkpoint, alone in `dest` (no COMPLETE: resumed)."""
    *_, ckpt = reference
    step = committed(ckpt)[0]
    shutil.copytree(step, dest / step.name)
    return dest / step.name


def _forge_hashes(step: Path) -> None:
    """What an attacker who can write the checkpoint directory also does: hashes that match."""
    record = json.loads((step / COMMITTED).read_text())
    record["files"] = content_hashes(step)
    (step / COMMITTED).write_text(json.dumps(record))


def _assert_refused(e, names: str, marker: Path) -> None:
    msg = str(e.value)
    assert not marker.exists()
    assert e.value.exit_code == 4 and "\n" not in msg and "\x1b" not in msg, msg
    assert "weights_only" not in msg, msg  # torch's advice: load it again with it off
    assert names in msg and "posix.system" in msg, msg


def test_a_crafted_rng_state_on_resume_is_refused_and_runs_nothing(staged, tmp_path, reference):
    step = _copy_first(reference, tmp_path / "ckpt")
    marker = tmp_path / "MARKER"
    torch.save({"torch": Payload(marker)}, step / "rng-rank0.pt")
    _forge_hashes(step)
    with pytest.raises(UntrustedCheckpointError) as e:
        run_local(tiny_cfg(*CKPT), staged, tmp_path / "run", checkpoints=tmp_path / "ckpt")
    _assert_refused(e, f"{step / 'rng-rank0.pt'}: holds something other than tensors", marker)
    assert f"delete {step}" in str(e.value)


def test_a_warm_start_from_a_crafted_metadata_is_refused_and_runs_nothing(
    staged, tmp_path, reference
):
    """checkpoint.resume_from=<dir> with checkpoint.warm_start=true reads only the weights,
    through the same safe reader as a resume."""
    step = _copy_first(reference, tmp_path / "theirs")
    marker = tmp_path / "MARKER"
    (step / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UntrustedCheckpointError) as e:
        run_local(tiny_cfg(*CKPT), staged, tmp_path / "run", weights_from=step)
    _assert_refused(e, f"{step / '.metadata'}: refers to posix.system", marker)
    assert not [e for e in read_events(tmp_path / "run") if e.get("name") == "warm_start"]


def test_a_resume_from_a_crafted_metadata_is_refused_and_runs_nothing(staged, tmp_path, reference):
    """The resume path reads `.metadata` through the safe reader (enn_core/runtime/safe_dcp.py),
    as every worker does: the crafted file is refused in one line (exit 4) and runs nothing."""
    step = _copy_first(reference, tmp_path / "ckpt")
    marker = tmp_path / "MARKER"
    (step / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _forge_hashes(step)
    with pytest.raises(UntrustedCheckpointError) as e:
        run_local(tiny_cfg(*CKPT), staged, tmp_path / "run", checkpoints=tmp_path / "ckpt")
    _assert_refused(e, f"{step / '.metadata'}: refers to posix.system", marker)


def test_a_resume_from_a_crafted_byte_item_is_refused_and_runs_nothing(staged, tmp_path, reference):
    """An optimizer value (`param_groups.0.lr`) is a pickled byte item inside a shard: a
    crafted one is refused by the resume's safe planner, and runs nothing."""
    import io

    step = _copy_first(reference, tmp_path / "ckpt")
    marker = tmp_path / "MARKER"
    metadata = pickle.loads((step / ".metadata").read_bytes())  # the test's own, genuine file
    index = next(k for k in metadata.storage_data if k.fqn.endswith("param_groups.0.lr"))
    info = metadata.storage_data[index]
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    shard = step / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    metadata.storage_data[index] = type(info)(info.relative_path, offset, len(payload.getvalue()))
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    _forge_hashes(step)
    with pytest.raises(UntrustedCheckpointError) as e:
        run_local(tiny_cfg(*CKPT), staged, tmp_path / "run", checkpoints=tmp_path / "ckpt")
    _assert_refused(e, f"{step}: item ", marker)


def test_a_best_checkpoint_naming_a_folder_elsewhere_is_refused(staged, tmp_path, reference):
    """trainer.json's best_checkpoint is where the run's end restores its weights from: a
    name that leads out of the checkpoint folder (`../victim/step-...`) is refused in one
    line, and nothing is read from there."""
    *_, ckpt = reference
    crafted = tmp_path / "ckpt"
    crafted.mkdir()
    for p in committed(ckpt)[:1]:
        dest = crafted / p.name
        shutil.copytree(p, dest)
        trainer = json.loads((dest / TRAINER).read_text())
        trainer.update(best_checkpoint=f"../victim/{p.name}", best_epoch=0)
        (dest / TRAINER).write_text(json.dumps(trainer))
        record = json.loads((dest / COMMITTED).read_text())
        record["files"] = content_hashes(dest)  # written so: no quarantine
        (dest / COMMITTED).write_text(json.dumps(record))
    with pytest.raises(UntrustedCheckpointError, match=r"best_checkpoint '\.\./victim/step-"):
        run_local(tiny_cfg(*CKPT), staged, tmp_path / "run", checkpoints=crafted)
