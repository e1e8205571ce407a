"""The training loop. Reads like a table of contents:

    setup -> restore -> for each epoch: train the epoch (named steps), validate, record,
          early stop?, save -> restore the best epoch's weights -> result

Preemption (enn_core.train.preempt): once the ranks agree that one of them got SIGTERM or
SIGUSR2, every rank saves at that step (or, after an epoch's last step, at the epoch's end)
and the loop ends with `Preempted`; the same run resumes from that checkpoint.

It runs identically in every worker (world size 1 included); everything rank-specific is in
`Runtime` (enn_core.runtime.dist's DistEnv, the wrapped model) and every decision that must
agree across ranks (skip, back off, clip, stop) is agreed by an all-reduce (train/step.py).
The state it works on is one typed object, `TrainState` (enn_core.train.state).

Telemetry: each step's data wait, compute, optimizer and communication seconds (the last
measured by `rt.comm`, which FSDP2's own all-gathers and reduce-scatters feed), and each
epoch's checkpoint seconds, are summed per epoch into its bottleneck verdict (data-,
compute-, communication-bound; enn_core.telemetry). Per-step timings are buffered and
written through the events log by rank 0 every `log_every` steps and at each epoch end.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

from enn_core.config import TrainConfig
from enn_core.errors import Preempted
from enn_core.metric_names import telemetry
from enn_core.runtime.dist import agree_any, tighten_timeout
from enn_core.runtime.memory import MemoryGovernor
from enn_core.runtime.sampler import GlobalBlockSampler, make_plan
from enn_core.runtime.watchdog import FIRST_FORWARD
from enn_core.telemetry import GpuSampler, memory_snapshot, verdict_from_stats, write_epoch
from enn_core.train.batch import choose_batch, choose_eval_batch, total_steps
from enn_core.train.best import before_training, keep_best, kept_in, restore_best
from enn_core.train.ckpt import step_name
from enn_core.train.evaluate import validate
from enn_core.train.guard import NonFiniteGuard
from enn_core.train.resume import Position, load_weights, resume, save_checkpoint
from enn_core.train.schedule import build_optimizer, build_scheduler
from enn_core.train.state import (
    EpochStats,
    Params,
    Runtime,
    TrainData,
    TrainResult,
    TrainState,
    holder_of,
)
from enn_core.train.step import StepOutcome, run_step

__all__ = ["Runtime", "TrainData", "TrainResult", "TrainState", "train"]

# Per-step metrics, buffered; flushed every `log_every` steps.
STEP_METRICS = 6
# Per-epoch values that are learning curves (`epoch/<name>`); the rest of an epoch's row is
# telemetry (`telemetry/epoch/<name>`): docs/metrics.md.
CURVES = frozenset({"train_loss", "lr", "val_loss", "val_mae", "val_rmse"})


def train(
    cfg: TrainConfig,
    data: TrainData,
    rt: Runtime,
    *,
    seed: int,
    log_every: int = 50,
    resume_from: Path | None = None,
    weights_from: Path | None = None,
) -> TrainResult:
    """Train with early stopping; the model ends holding the best epoch's weights.

    With a checkpointer, the state is saved every `checkpoint.every_steps` steps and at each
    epoch end, and `resume_from` (a committed checkpoint) continues at its exact step;
    `weights_from` (a checkpoint) gives only the starting weights (a warm start)."""
    st = setup(cfg, data, rt, seed=seed, log_every=log_every)
    if weights_from is not None:
        load_weights(st, weights_from)
    start = resume(st, resume_from) if rt.checkpointer is not None else Position(0, 0)
    st.progress.start_gstep = start.epoch * st.sampler.steps_per_epoch + start.step
    stopped = start.stopped
    for epoch in range(start.epoch, cfg.epochs):
        if stopped:
            break
        asked = train_epoch(st, epoch, first_step=start.step if epoch == start.epoch else 0)
        val = validate(st, epoch)
        record_epoch(st, epoch, val)
        stopped = early_stop(st, epoch, val) or capped(st, epoch)
        save_epoch_end(st, epoch, stopped)
        if asked and not stopped and epoch + 1 < cfg.epochs and rt.checkpointer is not None:
            raise preempted(st, st.epoch_end(epoch))
    restore_best(st)
    return result(st, stopped)


def setup(
    cfg: TrainConfig, data: TrainData, rt: Runtime, *, seed: int, log_every: int
) -> TrainState:
    # train.batch_size=auto: the stage resolves it before the workers start (its job and the
    # checkpoint fingerprint hold the number); a direct caller's "auto" is resolved here
    batch = choose_batch(cfg.batch_size, len(data.train_rows), rt.env.world_size)
    if cfg.batch_size == "auto":
        rt.events.param("train.batch_size_reason", batch.reason)
    sampler = GlobalBlockSampler(
        data.train_rows, batch.value, seed=seed, shuffle_block=cfg.shuffle_block
    )
    plan = make_plan(
        batch.value, cfg.micro_batch, rt.env.world_size, auto_micro_batch=rt.micro_batch
    )
    evals = choose_eval_batch(cfg.eval_batch, plan.micro_batch)
    cfg = replace(cfg, batch_size=batch.value)
    total = total_steps(cfg, sampler.steps_per_epoch)
    optimizer = build_optimizer([*rt.model.parameters(), *rt.loss.parameters()], cfg)
    scheduler = build_scheduler(optimizer, cfg, total_steps=total)
    guard = NonFiniteGuard(cfg.max_nonfinite_steps, rt.run_dir / "nonfinite", rank=rt.env.rank)
    governor = MemoryGovernor(plan, cfg.max_oom_backoffs)
    rt.events.param("train.batch_size", batch.value)
    rt.events.param("train.micro_batch", plan.micro_batch)
    rt.events.param("train.accumulation", plan.accumulation)
    rt.events.param("train.eval_batch", evals.value)
    rt.events.param("train.eval_batch_reason", evals.reason)
    rt.events.param("train.steps_per_epoch", sampler.steps_per_epoch)
    rt.events.param("train.total_steps", total)
    gpu = GpuSampler(rt.env.device) if rt.env.device.type == "cuda" and rt.env.is_main else None
    return TrainState(
        cfg=cfg,
        data=data,
        rt=rt,
        sampler=sampler,
        governor=governor,
        guard=guard,
        optimizer=optimizer,
        scheduler=scheduler,
        holder=holder_of(rt),
        params=Params.of(rt.model, rt.loss),
        log_every=max(1, log_every),
        total_steps=total,
        eval_batch=evals.value,
        gpu=gpu,
    )


def train_epoch(st: TrainState, epoch: int, first_step: int = 0) -> bool:
    """The epoch's steps from `first_step` (> 0 after a mid-epoch resume, whose partial
    statistics the checkpoint restored); timings and losses land in the history via
    record_epoch. Returns True when the ranks agreed to stop for preemption at its last step
    (the epoch-end checkpoint is then the one); earlier, it saves and raises `Preempted`."""
    rt, spe, prog = st.rt, st.sampler.steps_per_epoch, st.progress
    if st.gpu is not None:
        st.gpu.start()
    if first_step == 0 or prog.epoch is None:
        prog.epoch = EpochStats()
    es = prog.epoch
    es.ckpt_s += prog.ckpt_carry_s  # the previous epoch's end-of-epoch save
    prog.ckpt_carry_s = 0.0
    prior_s = es.wall_s
    every = rt.checkpointer.cfg.every_steps if rt.checkpointer is not None else 0
    last = min(spe, st.total_steps - epoch * spe)  # train.max_steps may end the epoch early
    before_training(st)  # the best epoch's weights are on disk before they change
    st.model_train()
    t0 = time.perf_counter()
    asked = False
    for step in range(first_step, last):
        gstep = epoch * spe + step
        if rt.heartbeat is not None:
            rt.heartbeat.phase(FIRST_FORWARD if gstep == prog.start_gstep else "step", gstep)
        if rt.faults.cfg.kind != "oom":  # OOM is injected at the step's agreement point (step.py)
            rt.faults.at("step", gstep)
        out = run_step(st, epoch, step, gstep)
        record_step(st, gstep, out)
        if gstep == prog.start_gstep and rt.steady_timeout_s:
            tighten_timeout(rt.steady_timeout_s)  # warm-up is over
        if rt.checkpointer is not None:
            c0 = time.perf_counter()
            rt.checkpointer.poll()  # an async save commits as soon as it is written
            es.ckpt_s += time.perf_counter() - c0
        asked = out.preempt
        stop = asked and step + 1 < last and rt.checkpointer is not None
        if stop or (every and (gstep + 1) % every == 0 and step + 1 < last):  # the end saves
            es.wall_s = prior_s + time.perf_counter() - t0  # the last step
            es.ckpt_s += timed_save(st, gstep + 1, epoch_end=False)
        if stop:
            raise preempted(st, gstep + 1)
    es.wall_s = prior_s + time.perf_counter() - t0
    return asked


def timed_save(st: TrainState, position: int, *, epoch_end: bool, stopped: bool = False) -> float:
    """Save a checkpoint at `position`; returns the seconds training was blocked by it."""
    t0 = time.perf_counter()
    save_checkpoint(st, position, epoch_end=epoch_end, stopped=stopped)
    return time.perf_counter() - t0


def preempted(st: TrainState, position: int) -> Preempted:
    """After the agreed save: wait until it is committed, record why, and the error that ends
    the worker (exit code 12: resume me)."""
    ckpt, watch = st.rt.checkpointer, st.rt.preempt
    assert ckpt is not None
    ckpt.wait()  # an asynchronous save is committed before the worker ends
    flush_telemetry(st)
    why = watch.describe() if watch is not None else "a peer rank's"
    st.rt.events.event("preempted", position=position, signal=why)
    return Preempted(
        f"stopped for preemption ({why} signal) at step {position}: checkpoint "
        f"{ckpt.root / step_name(position)} is committed; run the same command again to resume"
    )


def capped(st: TrainState, epoch: int) -> bool:
    """train.max_steps ended the run at this epoch, before train.epochs did (recorded once)."""
    end = st.epoch_end(epoch)
    if end < st.total_steps or st.total_steps == st.sampler.steps_per_epoch * st.cfg.epochs:
        return False
    st.rt.events.event("max_steps", step=end, epoch=epoch, max_steps=st.cfg.max_steps)
    return True


def save_epoch_end(st: TrainState, epoch: int, stopped: bool) -> None:
    """The epoch-end checkpoint (with a checkpointer). The epoch's record is written by then,
    so its seconds count in the next epoch's checkpoint time."""
    if st.rt.checkpointer is None:
        return
    position = st.epoch_end(epoch)
    st.progress.ckpt_carry_s += timed_save(st, position, epoch_end=True, stopped=stopped)
    if st.progress.best_held:  # this epoch is the best so far: the save holds its weights
        kept_in(st, st.rt.checkpointer.root / step_name(position))


def record_step(st: TrainState, gstep: int, out: StepOutcome) -> None:
    es, prog = st.epoch_stats, st.progress
    es.data_s += out.data_s
    es.compute_s += out.compute_s
    es.optim_s += out.optim_s
    es.comm_s += out.comm_s
    if out.applied:
        prog.applied_steps += 1
        es.loss += out.loss * out.weight
        es.weight += out.weight
        prog.step_losses.append(out.loss)
    else:
        es.skipped += 1
    prog.pending += [
        ("step/loss", out.loss, gstep),
        ("step/grad_norm", out.grad_norm, gstep),
        (telemetry("time/data_wait_s"), out.data_s, gstep),
        (telemetry("time/compute_s"), out.compute_s, gstep),
        (telemetry("time/optimizer_s"), out.optim_s, gstep),
        (telemetry("time/communication_s"), out.comm_s, gstep),
    ]
    if len(prog.pending) >= STEP_METRICS * st.log_every:
        flush_telemetry(st)


def flush_telemetry(st: TrainState) -> None:
    st.rt.events.metric_rows(st.progress.pending)  # one append for log_every steps' metrics
    st.progress.pending.clear()


def record_epoch(st: TrainState, epoch: int, val: dict[str, float] | None) -> None:
    es = st.epoch_stats
    # Rows seen this epoch on all ranks: each training row once (padding excluded); an epoch
    # that train.max_steps cut short ran full batches only
    steps = st.epoch_end(epoch) - epoch * st.sampler.steps_per_epoch
    rows = min(len(st.data.train_rows), steps * st.sampler.global_batch)
    wall = es.wall_s
    row = {
        "epoch": epoch,
        "train_loss": es.loss / es.weight if es.weight else math.nan,
        "lr": float(st.scheduler.get_last_lr()[0]),
        "samples_per_s": rows / wall if wall > 0 else math.nan,
        "data_wait_share": es.data_s / wall if wall > 0 else math.nan,
        "comm_share": es.comm_s / wall if wall > 0 else math.nan,
        "checkpoint_s": es.ckpt_s,
        "skipped_steps": es.skipped,
        "epoch_s": wall,
        "micro_batch": st.governor.plan.micro_batch,
    }
    if val is not None:
        row.update({f"val_{k}": v for k, v in val.items()})
    # Where the epoch's time went: data-, compute-, communication-bound or throttled.
    verdict = verdict_from_stats(es.as_record(), st.gpu.stop() if st.gpu is not None else None)
    write_epoch(
        st.rt.events,
        epoch,
        verdict,
        {"memory": memory_snapshot(st.rt.env.device), "samples_per_s": row["samples_per_s"]},
    )
    st.progress.history.append({**row, "bottleneck": verdict.bottleneck})
    flush_telemetry(st)
    names = {k: f"epoch/{k}" if k in CURVES else telemetry(f"epoch/{k}") for k in row}
    st.rt.events.metrics({names[k]: float(v) for k, v in row.items() if k != "epoch"}, step=epoch)
    # the launching process prints one line per epoch from this (enn_core/progress.py)
    st.rt.events.event("epoch", epochs=st.cfg.epochs, **row)


def early_stop(st: TrainState, epoch: int, val: dict[str, float] | None) -> bool:
    """Keep the best epoch's weights; stop after `patience` epochs without improvement."""
    if val is None:
        return False
    prog = st.progress
    loss = val["loss"]
    if math.isfinite(loss) and loss < prog.best_loss:
        prog.best_loss, prog.best_epoch, prog.bad_epochs = loss, epoch, 0
        keep_best(st)  # on disk, not a copy in memory (train/best.py)
    else:
        prog.bad_epochs += 1
    stop = st.cfg.patience > 0 and prog.bad_epochs >= st.cfg.patience
    stop = agree_any(stop, st.rt.env)  # identical inputs on every rank; agreed all the same
    if stop:
        st.rt.events.event(
            "early_stop", epoch=epoch, best_epoch=prog.best_epoch, best_val_loss=prog.best_loss
        )
    return stop


def result(st: TrainState, stopped: bool) -> TrainResult:
    prog = st.progress
    best = next((h for h in prog.history if h["epoch"] == prog.best_epoch), None)
    return TrainResult(
        history=prog.history,
        step_losses=prog.step_losses,
        best_epoch=prog.best_epoch,
        stopped_early=stopped,
        applied_steps=prog.applied_steps,
        skipped_steps=st.guard.total_skipped,
        backoffs=list(st.governor.history),
        micro_batch=st.governor.plan.micro_batch,
        accumulation=st.governor.plan.accumulation,
        best_val=best,
    )
