"""Doctor, checkpoints layer.

- dcp round trip: the model's state (and a step counter) saved with
  torch.distributed.checkpoint into a temporary directory beside the training checkpoints
  (`<work>/checkpoints`, the filesystem they will use), loaded into fresh tensors and
  compared bit for bit, with the write rate. No process group: a single-process save.
- consolidated: an existing `init.pt` / `model.pt` loads (weights_only) and was made from the
  staged data it sits next to (its data fingerprint equals the manifest's content hash).
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.api import CheckpointException

from enn_core.doctor.context import DoctorContext, gib
from enn_core.doctor.report import Check, Recorder
from enn_core.errors import EnnError
from enn_core.runtime import safe_dcp
from enn_core.stages import DISTRIBUTED_TRAIN, PREPARE_CHECKPOINT

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE


def run(ctx: DoctorContext) -> list[Check]:
    rec = Recorder("checkpoints")
    dcp_round_trip(rec, ctx.layout.checkpoints, _state(ctx))
    consolidated(ctx, rec)
    return rec.checks


def _state(ctx: DoctorContext) -> dict[str, torch.Tensor]:
    model: torch.nn.Module
    try:
        model = ctx.model()
    except EnnError:  # the model layer reports it; round-trip a small stand-in module's state
        model = torch.nn.Linear(64, 64)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def dcp_round_trip(rec: Recorder, parent: Path, state: dict[str, torch.Tensor]) -> None:
    import torch.distributed.checkpoint as dcp

    size = sum(t.numel() * t.element_size() for t in state.values())
    try:
        parent.mkdir(parents=True, exist_ok=True)
        where = Path(tempfile.mkdtemp(prefix=".doctor-dcp-", dir=parent))
    except OSError as e:
        rec.add(
            "dcp round trip",
            "fail",
            f"cannot create a directory in {parent}: {e.strerror or e}",
            "make runtime.work_dir (or ENN_WORK_DIR) writable, with free space",
        )
        return
    try:
        with rec.timer() as t, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
            try:
                dcp.save({"model": state, "step": torch.tensor(7)}, checkpoint_id=str(where))
                save_s = t()
                back: STATE_DICT_TYPE = {
                    "model": {k: torch.zeros_like(v) for k, v in state.items()},
                    "step": torch.tensor(0),
                }
                safe_dcp.load(back, where)  # as training reads: nothing runs from the file
            except (OSError, RuntimeError, CheckpointException) as e:
                first = _first_line(e)
                rec.add(
                    "dcp round trip",
                    "fail",
                    f"DCP save/load in {where} failed: {first}",
                    "the training checkpoint directory (runtime.work_dir/checkpoints) "
                    "must be writable with free space",
                    t(),
                    path=str(where),
                )
                return
            secs = t()
    finally:
        shutil.rmtree(where, ignore_errors=True)
    same = all(torch.equal(state[k], back["model"][k]) for k in state) and int(back["step"]) == 7
    if not same:
        rec.add(
            "dcp round trip",
            "fail",
            f"DCP load of {where} did not return the saved tensors",
            "check the filesystem of runtime.work_dir (a cache or sync layer rewriting files?)",
            secs,
        )
        return
    rate = size / save_s / 2**20 if save_s > 0 else float("inf")
    rec.add(
        "dcp round trip",
        "ok",
        f"{len(state)} tensors ({gib(size)}) saved at {rate:.0f} MiB/s and loaded "
        f"bit-exact in {secs:.2f} s under {parent}",
        seconds=secs,
        bytes=size,
    )


def _first_line(e: BaseException) -> str:
    """The root error of a DCP failure (CheckpointException wraps each rank's exception)."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def consolidated(ctx: DoctorContext, rec: Recorder) -> None:
    from enn_core.checkpoint import FORMAT_VERSION, read_checkpoint

    found = [
        p
        for p in (
            PREPARE_CHECKPOINT.output_dir(ctx.layout) / "init.pt",
            DISTRIBUTED_TRAIN.output_dir(ctx.layout) / "model.pt",
        )
        if p.exists()
    ]
    if not found:
        rec.add(
            "consolidated",
            "skip",
            f"no init.pt or model.pt yet (run {PREPARE_CHECKPOINT.name} / "
            f"{DISTRIBUTED_TRAIN.name})",
        )
        return
    fingerprint = _staged_fingerprint(ctx)
    for path in found:
        with rec.timer() as t:
            try:
                ckpt = read_checkpoint(path)
            except EnnError as e:
                rec.add(f"{path.name}", "fail", str(e), "re-run the stage that wrote it", t())
                continue
            secs = t()
        theirs = ckpt.data_fingerprint
        detail = (
            f"{path}: format v{FORMAT_VERSION}, {len(ckpt.state_dict)} tensors, "
            f"torch {ckpt.torch_version}"
        )
        if fingerprint and theirs and theirs != fingerprint:
            rec.add(
                path.name,
                "warn",
                f"{detail}; made from other data ({str(theirs)[:12]} != staged {fingerprint[:12]})",
                "re-run prepare-checkpoint and distributed-train on the current staged data",
                secs,
            )
        else:
            rec.add(
                path.name,
                "ok",
                detail + ("; matches the staged data" if fingerprint else ""),
                seconds=secs,
            )


def _staged_fingerprint(ctx: DoctorContext) -> str:
    from enn_core.data.manifest import read_manifest

    try:
        return read_manifest(ctx.staged_dir).content_hash
    except EnnError:
        return ""
