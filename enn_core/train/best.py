"""The best epoch's weights, which early stopping restores at the end of the run: kept on
disk, never as a second copy of the weights in memory (issue 55).

    keep_best(st, epoch)       # validation improved: the live weights are the best ones
    kept_in(st, path)          # ... and a committed checkpoint holds them (the epoch-end save)
    before_training(st)        # weights are about to change: the best ones must be on disk
    restore_best(st)           # the end: the model holds the best epoch's weights

Where the best weights lie:
- with a checkpointer (every training stage has one): the best epoch's committed epoch-end
  checkpoint, which retention keeps (enn_core.train.ckpt) and the resume points to
  (trainer.json's "best_checkpoint"). Nothing is written for it; restoring loads its model
  state through DCP, in place (the run's own sharding, any world size);
- without one (a direct caller of `train`): each rank's own tensors, in a file of the run
  directory (`best-weights/rank-<r>.pt`), written only when a later epoch is about to train
  and removed once restored;
- nowhere, while the live weights are still the best ones (the best epoch is the last one
  trained, or the checkpoint resumed from is the best): restoring is then nothing to do.

A snapshot in memory (the old way) held a full copy of the rank's weights from the first
improvement to the end: one more unit of the weights beside weights, gradients and AdamW's
two moments. The restored values are the saved bytes either way, so results are unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from enn_core.runtime import safe_dcp
from enn_core.tensor_file import load_tensors
from enn_core.train.state import TrainState

FOLDER = "best-weights"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def keep_best(st: TrainState) -> None:
    """Validation improved: the live weights are the best epoch's (nothing on disk yet)."""
    _file(st).unlink(missing_ok=True)  # an earlier best epoch's, if any
    st.progress.best_held, st.progress.best_path = True, None


def kept_in(st: TrainState, path: Path) -> None:
    """A checkpoint of the best epoch's weights (its epoch-end save) is at `path`."""
    st.progress.best_path = path


def before_training(st: TrainState) -> None:
    """Training is about to change the weights: without a checkpoint of them, the best ones
    go to this rank's file in the run directory first."""
    prog = st.progress
    if not prog.best_held:
        return
    if prog.best_path is None:
        prog.best_path = _write(st)
    prog.best_held = False


def _file(st: TrainState) -> Path:
    return st.rt.run_dir / FOLDER / f"rank-{st.rt.env.rank}.pt"


def _write(st: TrainState) -> Path:
    target = _file(st)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    torch.save([_local(t).detach() for t in st.tensors()], tmp)
    os.replace(tmp, target)
    return target


def restore_best(st: TrainState) -> None:
    """The end of the run: the model holds the best epoch's weights (bit-identical)."""
    prog = st.progress
    if prog.best_epoch is None:
        return
    loaded = not prog.best_held
    if loaded:
        if prog.best_path is None:
            raise RuntimeError("the best epoch's weights were not kept: before_training")
        if prog.best_path.is_dir():
            _from_checkpoint(st, prog.best_path)
        else:
            _from_file(st, prog.best_path)
        prog.best_held = True
    _file(st).unlink(missing_ok=True)  # written for the restore: done
    st.rt.events.event(
        "restored_best", epoch=prog.best_epoch, val_loss=prog.best_loss, loaded=loaded
    )


def _from_checkpoint(st: TrainState, path: Path) -> None:
    if st.rt.checkpointer is not None:
        st.rt.checkpointer.wait()  # an asynchronous epoch-end save is committed first
    state = {"model": get_model_state_dict(st.holder)}
    safe_dcp.load(state, path)  # in place, into the run's own shards; runs no code
    set_model_state_dict(st.holder, state["model"])


def _from_file(st: TrainState, path: Path) -> None:
    fix = f"delete {path.parent} and train again"
    saved = load_tensors(path, name=str(path), what="the best epoch's weights", fix=fix, mmap=True)
    with torch.no_grad():
        for t, s in zip(st.tensors(), saved, strict=True):
            _local(t).copy_(s)
    del saved
