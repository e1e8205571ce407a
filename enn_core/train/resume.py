"""What a training checkpoint holds, and how the loop saves and resumes it.

    save_checkpoint(st, position, epoch_end=..., stopped=...)   # every N steps, epoch ends
    start = resume(st, path)                                   # -> Position to continue from

DCP state: the model and the loss's parameters (Student-t scale) under one holder module
(`TrainState.holder`: keys "model.*" and "loss.*"), and
the optimizer, as sharded state dicts (`torch.distributed.checkpoint.state_dict`), so a
checkpoint written by N ranks loads at any world size (DCP reshards). `trainer.json`: the
global position (steps done), the scheduler, the gradient scaler, early stopping (best loss,
epoch, patience count and the best epoch's checkpoint), the non-finite guard, the OOM
governor, the loss curve and the partial epoch's statistics. Per-rank RNG states are restored
at the same world size (bit-identical resume); at another world size each rank keeps its
seeded stream (the sampler's state is a global position, so the batches are the same).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from enn_core.errors import ConfigError, UntrustedCheckpointError
from enn_core.metric_names import telemetry
from enn_core.runtime import safe_dcp
from enn_core.runtime.sampler import Plan
from enn_core.tensor_file import load_tensors
from enn_core.train.ckpt import TRAINER, read_trainer, step_name
from enn_core.train.state import EpochStats, TrainState

FORMAT = 1


@dataclass(frozen=True)
class Position:
    epoch: int
    step: int  # first step to run in `epoch`
    stopped: bool = False  # early stopping had already ended the run

    @property
    def fresh(self) -> bool:
        return self.epoch == 0 and self.step == 0 and not self.stopped


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else repr(x)


def trainer_state(
    st: TrainState, position: int, *, epoch_end: bool, stopped: bool
) -> dict[str, Any]:
    spe, prog = st.sampler.steps_per_epoch, st.progress
    best = step_name(st.epoch_end(prog.best_epoch)) if prog.best_epoch is not None else None
    partial = {} if epoch_end or prog.epoch is None else prog.epoch.as_record()
    return {
        "format": FORMAT,
        "position": position,
        "epoch": position // spe,
        "step": position % spe,
        "steps_per_epoch": spe,
        "epoch_end": epoch_end,
        "stopped": stopped,
        "world_size": st.rt.env.world_size,
        "attempt": st.rt.env.restart,
        "saved_at": time.time(),
        "scheduler": st.scheduler.state_dict(),
        "grad_scaler": st.scaler.state_dict() if st.scaler is not None else None,
        "best_loss": _json_float(prog.best_loss),
        "best_epoch": prog.best_epoch,
        "best_checkpoint": best,
        "bad_epochs": prog.bad_epochs,
        "applied_steps": prog.applied_steps,
        "history": prog.history,
        "step_losses": prog.step_losses,
        "epoch_stats": partial,
        "guard": {"consecutive": st.guard.consecutive, "total_skipped": st.guard.total_skipped},
        "governor": {"micro_batch": st.governor.plan.micro_batch, "history": st.governor.history},
    }


def save_checkpoint(
    st: TrainState, position: int, *, epoch_end: bool, stopped: bool = False
) -> None:
    ckpt = st.rt.checkpointer
    if ckpt is None:
        raise RuntimeError("save_checkpoint needs a checkpointer (Runtime.checkpointer)")
    hb = st.rt.heartbeat
    if hb is not None:
        hb.phase("checkpoint", position)
    model_sd, optim_sd = get_state_dict(st.holder, st.optimizer)
    ckpt.save(
        {"model": model_sd, "optim": optim_sd},
        trainer_state(st, position, epoch_end=epoch_end, stopped=stopped),
        position,
    )
    st.rt.events.metric(telemetry("checkpoint/position"), position, position)
    if hb is not None:
        hb.phase("step", position)


def resume(st: TrainState, path: Path | None) -> Position:
    """Load `path` (a committed checkpoint) into the loop state; Position(0, 0) when None."""
    if path is None:
        return Position(0, 0)
    trainer = read_trainer(path)
    best = trainer.get("best_checkpoint")
    if best and trainer.get("best_epoch") is not None:
        # restored from there at the end (train/best.py); the one resumed from may be it. A
        # name that is not a checkpoint folder beside this one (`../elsewhere`) is refused:
        # the file may not choose what the run reads its weights from
        if not (isinstance(best, str) and re.fullmatch(r"step-\d{8,}", best)):
            raise UntrustedCheckpointError(
                f"{path / TRAINER}: best_checkpoint {str(best)[:80]!r} is not a checkpoint "
                f"of {path.parent} (step-NNNNNNNN); delete {path} (resume falls back to an "
                "earlier one) or re-train"
            )
        st.progress.best_path = path.parent / best
        st.progress.best_held = best == path.name
    model_sd, optim_sd = get_state_dict(st.holder, st.optimizer)
    safe_dcp.load({"model": model_sd, "optim": optim_sd}, path)  # in place; runs no code
    set_state_dict(st.holder, st.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    _restore_trainer(st, trainer)
    _restore_rng(st, path, trainer)
    st.rt.events.event(
        "resumed",
        checkpoint=str(path),
        position=trainer["position"],
        saved_world_size=trainer["world_size"],
        world_size=st.rt.env.world_size,
    )
    return Position(trainer["epoch"], trainer["step"], bool(trainer.get("stopped")))


def load_weights(st: TrainState, path: Path) -> None:
    """Only the model (and loss) weights of a checkpoint: a warm start at step 0."""
    state = {"model": get_model_state_dict(st.holder)}
    try:
        safe_dcp.load(state, path)
    except UntrustedCheckpointError:
        raise
    except Exception as e:  # DCP raises on missing keys or shapes: another architecture
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"checkpoint.resume_from={path}: its weights do not fit this model ({first[:200]}); "
            "match model.* to the run that wrote it, or clear checkpoint.resume_from"
        ) from e
    set_model_state_dict(st.holder, state["model"])
    st.rt.events.event("warm_start", checkpoint=str(path))


def _restore_trainer(st: TrainState, t: dict[str, Any]) -> None:
    if t["steps_per_epoch"] != st.sampler.steps_per_epoch:
        raise RuntimeError(
            "steps per epoch differ from the checkpoint's despite an equal fingerprint"
        )
    st.scheduler.load_state_dict(t["scheduler"])
    if st.scaler is not None and t.get("grad_scaler"):
        st.scaler.load_state_dict(t["grad_scaler"])
    prog = st.progress
    prog.best_loss = float(t["best_loss"])
    prog.best_epoch, prog.bad_epochs = t["best_epoch"], t["bad_epochs"]
    prog.applied_steps = t["applied_steps"]
    prog.history, prog.step_losses = list(t["history"]), list(t["step_losses"])
    prog.epoch = EpochStats.from_record(t["epoch_stats"]) if t["epoch_stats"] else None
    st.guard.consecutive = t["guard"]["consecutive"]
    st.guard.total_skipped = t["guard"]["total_skipped"]
    gov = t["governor"]
    st.governor.history = list(gov["history"])
    if (
        t["world_size"] == st.rt.env.world_size
        and gov["micro_batch"] != st.governor.plan.micro_batch
    ):
        plan = st.governor.plan
        st.governor.plan = Plan(plan.global_batch, plan.world_size, gov["micro_batch"])


def _restore_rng(st: TrainState, path: Path, trainer: dict[str, Any]) -> None:
    f = path / f"rng-rank{st.rt.env.rank}.pt"
    if trainer["world_size"] != st.rt.env.world_size or not f.exists():
        return
    rng = load_tensors(
        f,
        name=str(f),
        what="RNG state",
        fix=f"delete {path} (resume falls back to an earlier one) or re-train",
    )
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


__all__ = ["TRAINER", "Position", "resume", "save_checkpoint", "trainer_state"]
