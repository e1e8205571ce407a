"""The worker entry point: what each elastic worker process runs (world size 1 included).

    main(job_path) -> summary dict

The job file (a `WorkerJob`, enn_core.train.job, written by enn_core.train.stage) holds the
resolved config and the paths. The worker walks named phases, each announced on its
heartbeat so the launcher's watchdog can name where a silent rank stopped: bootstrap ->
process_group -> load -> wrap -> first_forward -> step N -> validate -> checkpoint -> done.
An exception is written to `<run_dir>/errors/rank-<r>.json` (the launcher turns it into the
caller's error) and re-raised. Rank 0 writes model.pt, record.json and history.json to the
job's result dir.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import logging
import os
import shutil
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.nn.parallel import DistributedDataParallel

from enn_core.atomic import atomic_dir, open_own, write_json
from enn_core.checkpoint import load_model, save_consolidated
from enn_core.config import RunConfig
from enn_core.data.dataset import StagedDataset
from enn_core.data.manifest import StagedManifest
from enn_core.errors import ConfigError, OutOfMemory
from enn_core.events import EventLog
from enn_core.fault import FaultInjector
from enn_core.losses import make_loss, resolve_loss
from enn_core.model.enn import ENN
from enn_core.model_code import ModelCode
from enn_core.runtime.batch_probe import (
    MicroBatchChoice,
    agree_choice,
    choose_micro_batch,
    sample_from_staged,
)
from enn_core.runtime.comm_clock import CommClock, time_fsdp_collectives
from enn_core.runtime.dist import (
    DistEnv,
    apply_parallelism,
    bootstrap,
    gather_objects,
    ranks_not_sharing,
    shutdown,
)
from enn_core.runtime.heartbeat import Heartbeat
from enn_core.runtime.kernels import apply_attention, choose_attention
from enn_core.runtime.malloc import set_mmap_threshold
from enn_core.runtime.memory import release_free_heap
from enn_core.runtime.memory_limit import AnonWatch, end_process
from enn_core.runtime.network import choose_interface
from enn_core.runtime.parent import die_with_parent
from enn_core.runtime.precision import PrecisionDecision, choose_precision
from enn_core.runtime.watchdog import write_error
from enn_core.train.batch import choose_batch
from enn_core.train.ckpt import Checkpointer
from enn_core.train.job import SHARED_OUTPUTS, WorkerJob
from enn_core.train.loop import Runtime, TrainData, TrainResult, train
from enn_core.train.preempt import PreemptWatch


def same_fingerprint(digest: str, env: DistEnv) -> None:
    """Every rank trains the same job (data, model/train config, torch version), or none
    starts: nodes with different configs would otherwise look for each other's checkpoints
    in different fingerprint folders (and be told their shared folder is node-local)."""
    seen = gather_objects([os.uname().nodename, digest], env)
    by_digest: dict[str, str] = {}
    for host, d in seen:
        by_digest.setdefault(d, host)
    if len(by_digest) > 1:
        named = ", ".join(f"{d[:12]} on {host}" for d, host in by_digest.items())
        raise ConfigError(
            f"the nodes' configs differ (fingerprint {named}): every node needs the same data, "
            "model and train config and torch version (the same commit, dvc pull)"
        )


def _log_to_file(run_dir: Path, rank: int, level: str) -> logging.Logger:
    path = run_dir / "logs" / f"rank-{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.StreamHandler(os.fdopen(open_own(path), "a"))  # no link followed
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    )
    logger = logging.getLogger("enn")
    logger.addHandler(handler)
    logger.setLevel(level)
    return logging.getLogger("enn.worker")


def main(job_path: str) -> dict[str, Any]:
    job = WorkerJob.read(job_path)
    set_mmap_threshold(job.config.runtime.malloc_mmap_threshold_mb)  # before the model loads
    rank = int(os.environ.get("RANK", "0"))
    die_with_parent()  # the launcher's process: torchrun, enn's or an external one
    hb = Heartbeat(
        job.run_dir, rank, attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ).start()
    log = _log_to_file(job.run_dir, rank, job.config.runtime.log_level)
    watch = watch_memory(job, hb, rank, log)
    try:
        summary = _run(job, hb, rank, log)
        hb.stop("done")
        watch.stop()
        summary["anon_peak_mib"] = watch.peaks_mib()
        return summary
    except BaseException as e:
        write_error(job.run_dir, rank, e, *hb.where(), traceback.format_exc())
        if isinstance(e, KeyboardInterrupt):  # Ctrl-C, forwarded by the launcher: no error
            log.warning("interrupted in phase %s", hb.where()[0])
        else:
            log.error("failed in phase %s: %s", hb.where()[0], str(e) or type(e).__name__)
        raise
    finally:
        watch.stop()
        shutdown()


def watch_memory(job: WorkerJob, hb: Heartbeat, rank: int, log: logging.Logger) -> AnonWatch:
    """This worker's anonymous memory, watched from now on: its peak per phase for the summary,
    and past `runtime.worker_memory_limit_mb` the process ends with its one-line error record
    (enn_core.runtime.memory_limit says why a sampled limit and not RLIMIT_DATA)."""

    def over(err: OutOfMemory, phase: str, step: int | None) -> None:
        write_error(job.run_dir, rank, err, phase, step, "")
        log.error("failed in phase %s: %s", phase, err)
        for handler in logging.getLogger("enn").handlers:
            handler.flush()
        # the launcher reads the record; under an external one this process is the stage's
        where = f" in phase {phase}" + (f" step {step}" if step is not None else "")
        print(f"error: distributed-train: rank {rank}{where}: {err}", file=sys.stderr, flush=True)
        end_process(err.exit_code)

    limit = job.config.runtime.worker_memory_limit_mb
    return AnonWatch(hb.where, limit, over).start()


def _run(job: WorkerJob, hb: Heartbeat, rank: int, log: logging.Logger) -> dict[str, Any]:
    cfg, run_dir = job.config, job.run_dir
    faults = FaultInjector(cfg.fault, rank=rank, marker_dir=job.marker_dir)
    faults.at("bootstrap")
    hb.phase("process_group")
    net = cfg.runtime
    interface = choose_interface(net.socket_ifname, net.local_addr, net.nnodes)
    env = bootstrap(
        device=cfg.runtime.device,
        threads=job.threads,
        seed=cfg.runtime.seed,
        deterministic=cfg.runtime.deterministic,
        pg_timeout_s=cfg.runtime.pg_timeout_s,
        compile=cfg.train.compile,
        hsdp_replicas=cfg.train.hsdp_replicas,
        interface=interface,
    )
    faults.at("process_group")
    log.info(
        "process group up: rank %d of %d on %s (%s)",
        env.rank,
        env.world_size,
        env.device,
        env.backend,
    )
    hb.phase("load")
    data = StagedDataset(job.staged)
    labels = _labels(data)
    model, _ = load_model(job.init, ModelCode.of(cfg.model, job.root))
    model.train()
    precision = choose_precision(cfg.train, env.device)
    attention = choose_attention(
        cfg.train,
        env.device,
        precision.dtype,
        heads=cfg.model.heads,
        head_dim=max(1, cfg.model.d_model // cfg.model.heads),
    )
    apply_attention(attention)
    hb.phase("compile" if cfg.train.compile else "wrap")
    faults.at("wrap")
    param_dtype = None if precision.name == "fp32" else precision.dtype
    wrapped, wrap = apply_parallelism(
        model, env, param_dtype=param_dtype, compile=cfg.train.compile, fsdp=cfg.train.fsdp
    )
    comm = CommClock()  # FSDP2's own all-gathers and reduce-scatters feed it (and the loop's)
    time_fsdp_collectives(wrapped, comm, faults.collective_delays())
    loss = make_loss(cfg.train, cfg.model.preset).to(env.device)
    events = EventLog(run_dir, enabled=env.is_main)
    loss_name, loss_why = resolve_loss(cfg.train, cfg.model.preset)
    events.param("train.loss", f"{loss_name} ({loss_why})")
    choices = {
        **precision.as_record(),
        **attention.as_record(),
        **wrap,
        **interface.as_record(),
        "threads": job.threads,
        "device": str(env.device),
    }
    micro = None
    if cfg.train.micro_batch == "auto":  # after wrap, before the optimizer exists
        hb.phase("probe_batch")
        choice = auto_micro_batch(cfg, data, env, _Probed(wrapped, model, loss, precision))
        micro = choice.micro_batch
        choices.update(choice.as_record())
    for k, v in choices.items():
        events.param(
            f"runtime.{k}",
            v if isinstance(v, (str, int, float, bool)) else json.dumps(v, default=str),
        )
    ckpt, resume_from = _checkpointer(job, env, events, faults)
    # SIGTERM/SIGUSR2 during training: save at an agreed step and end (train/preempt.py);
    # without checkpoints there is nothing to resume, and the signals keep their default
    watch = PreemptWatch() if ckpt is not None else None
    rt = Runtime(
        env=env,
        model=wrapped,
        core=model,
        loss=loss,
        run_dir=run_dir,
        events=events,
        faults=faults,
        heartbeat=hb,
        autocast=precision.autocast,
        grad_scaler=precision.grad_scaler(),
        full_state=functools.partial(full_state, wrapped, env),
        steady_timeout_s=cfg.runtime.pg_timeout_steady_s,
        micro_batch=micro,
        checkpointer=ckpt,
        comm=comm,
        preempt=watch,
    )
    train_data = TrainData(data.features, labels, data.split("train"), _val_rows(data))
    try:
        with watch or contextlib.nullcontext():
            result = train(
                cfg.train,
                train_data,
                rt,
                seed=cfg.runtime.seed,
                log_every=cfg.train.log_every,
                resume_from=resume_from,
                weights_from=job.checkpoint.weights_path if job.checkpoint else None,
            )
        hb.phase("checkpoint")
        faults.at("checkpoint")
        # The training state is garbage now, but in reference cycles that a collection
        # frees (AdamW's moments: 380 MiB a rank at 99M parameters and world size 2),
        # and its pages go back before rank 0 gathers the full weights (issue 55)
        gc.collect()
        release_free_heap()
        state = full_state(wrapped, env, final=True)
        summary = {**_summary(result, env, choices), **rank_summary(result, env)}
        summary["checkpoint"] = _ckpt_summary(ckpt, resume_from, env)
        if env.is_main:
            write_outputs(job, state, loss, data.manifest, result, summary)
        if ckpt is not None and cfg.runtime.nnodes > 1:
            share_outputs(job, ckpt, env)
        if ckpt is not None:
            ckpt.complete()
    finally:
        if ckpt is not None:
            ckpt.close()
    del wrapped, model, rt, loss, state  # before destroy_process_group: the FSDP2 exit-abort fix
    return summary if env.is_main else rank_summary(result, env)


def _labels(data: StagedDataset) -> np.ndarray:
    if data.labels is None:
        raise ConfigError(
            f"{data.path}: the staged data has no labels; distributed-train needs labeled "
            "data (stage-data with a label column)"
        )
    return data.labels


@dataclass(frozen=True)
class _Probed:
    """What the micro-batch probe trains: the wrapped model, its bare core, the loss."""

    wrapped: torch.nn.Module
    model: ENN
    loss: torch.nn.Module
    precision: PrecisionDecision


def auto_micro_batch(
    cfg: RunConfig, data: StagedDataset, env: DistEnv, probed: _Probed
) -> MicroBatchChoice:
    """`train.micro_batch: auto`: the largest micro-batch that fits memory, agreed by all ranks."""
    sample = sample_from_staged(
        data.features, _labels(data), data.split("train"), env.device, probed.model.normalize
    )
    choice = choose_micro_batch(
        probed.wrapped,
        probed.loss,
        sample,
        # the stage resolved train.batch_size=auto into the job; the same rule if it did not
        choose_batch(cfg.train.batch_size, len(data.split("train")), env.world_size).value
        // env.world_size,
        env.device,
        headroom=cfg.train.memory_headroom,
        autocast=probed.precision.autocast,
        distributed=env.distributed,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    )
    return agree_choice(choice, env)


def _checkpointer(
    job: WorkerJob, env: DistEnv, events: EventLog, faults: FaultInjector
) -> tuple[Checkpointer | None, Path | None]:
    """The DCP checkpointer of this job's fingerprint directory and the checkpoint to resume."""
    plan, cfg = job.checkpoint, job.config
    if plan is None:
        return None, None
    if cfg.runtime.nnodes > 1:
        same_fingerprint(plan.digest, env)
    if cfg.runtime.nnodes > 1 and (blind := ranks_not_sharing(plan.dir, env)):
        raise ConfigError(
            f"ranks {blind} do not see the checkpoint directory {plan.dir} that rank 0 writes "
            "(a node-local disk); set checkpoint.dir to a directory on storage every node shares"
        )
    ckpt = Checkpointer(
        plan.dir,
        cfg.checkpoint,
        rank=env.rank,
        distributed=env.distributed,
        attempt=env.restart,
        on_event=events.event,
        before_commit=lambda position: faults.at("checkpoint_save", position),
    )
    explicit = plan.resume_from is not None
    latest = ckpt.prepare(resume=cfg.checkpoint.resume, keep=explicit or env.restart > 0)
    chosen = plan.resume_path
    if env.restart > 0 or chosen is None:
        chosen = latest if latest is not None else chosen  # a restarted attempt takes the newest
    return ckpt, chosen


def _ckpt_summary(ckpt: Checkpointer | None, resume_from: Path | None, env: DistEnv) -> dict:
    if ckpt is None:
        return {}
    return {
        "dir": str(ckpt.root),
        "resumed_from": str(resume_from) if resume_from else "",
        "quarantined": list(ckpt.quarantined),
        "saved_positions": ckpt.saved,
        "attempt": env.restart,
    }


def rank_summary(result: TrainResult, env: DistEnv) -> dict[str, Any]:
    """What every rank decided: the caller checks that the ranks agreed."""
    losses = ",".join(float(v).hex() for v in result.step_losses)
    return {
        "rank": env.rank,
        "step_losses_sha": hashlib.sha256(losses.encode()).hexdigest()[:16],
        "applied_steps": result.applied_steps,
        "skipped_steps": result.skipped_steps,
        "oom_backoffs": len(result.backoffs),
        "micro_batch": result.micro_batch,
        "best_epoch": result.best_epoch,
        "epochs_run": len(result.history),
    }


def _val_rows(data: StagedDataset) -> np.ndarray:
    return data.split("val") if "val" in data.split_names else data.split("train")[:0]


def full_state(
    model: torch.nn.Module, env: DistEnv, *, final: bool = False
) -> dict[str, torch.Tensor]:
    """The full, unsharded state dict on CPU (a collective under FSDP2: every rank calls it).

    `final` (model.pt, which rank 0 alone writes, at once): under FSDP2 only rank 0 keeps the
    gathered weights (the others get {} and never hold the whole model), and no tensor is
    copied here (save_consolidated copies only what it must): issue 55."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    if env.distributed and any(hasattr(p, "full_tensor") for p in model.parameters()):
        full = StateDictOptions(full_state_dict=True, cpu_offload=final)  # offload: rank 0 only
        sd = get_model_state_dict(model, options=full)
    else:
        sd = model.state_dict()
    return _cpu_copies(sd, copy=not final)


def _cpu_copies(sd: Mapping[str, Any], copy: bool = True) -> dict[str, torch.Tensor]:
    """A model state dict's tensors (gathered ones under FSDP2), copied to the CPU (`copy`;
    otherwise as they are)."""
    names = {k: k.replace("_orig_mod.", "") for k in sd}
    if not copy:
        return {names[k]: v.detach() for k, v in sd.items()}
    return {names[k]: v.detach().to("cpu").clone() for k, v in sd.items()}


def _summary(result: TrainResult, env: DistEnv, choices: dict) -> dict[str, Any]:
    best = result.best_val or (result.history[-1] if result.history else {})
    return {
        "world_size": env.world_size,
        "best_epoch": result.best_epoch,
        "epochs_run": len(result.history),
        "stopped_early": result.stopped_early,
        "applied_steps": result.applied_steps,
        "skipped_steps": result.skipped_steps,
        "oom_backoffs": len(result.backoffs),
        "micro_batch": result.micro_batch,
        "accumulation": result.accumulation,
        "val_loss": best.get("val_loss"),
        "val_mae": best.get("val_mae"),
        "val_rmse": best.get("val_rmse"),
        "train_loss": best.get("train_loss"),
        "samples_per_s": best.get("samples_per_s"),
        "precision": choices.get("precision"),
        "attention": choices.get("attention"),
        "compile": choices.get("compile"),
        "wrap": choices.get("wrap"),
    }


def share_outputs(job: WorkerJob, ckpt: Checkpointer, env: DistEnv) -> None:
    """A job across nodes: rank 0 also puts its outputs into the checkpoint folder every node
    shares (`<checkpoint dir>/<digest>/published/`), and every rank waits until it has, so
    each node's stage can publish the same model.pt in its own checkout (the later stages, and
    a prediction across the nodes, find it there with no copying by hand)."""
    if env.is_main:
        with atomic_dir(ckpt.root / SHARED_OUTPUTS) as tmp:
            for name in ("model.pt", "record.json", "history.json"):
                shutil.copy2(job.result_dir / name, tmp / name)
    if env.distributed:
        torch.distributed.barrier()


def write_outputs(
    job: WorkerJob,
    state: dict,
    loss: torch.nn.Module,
    manifest: StagedManifest,
    result: TrainResult,
    summary: dict,
) -> None:
    """Rank 0: the consolidated checkpoint, the workers' record and history (the stage
    publishes them, with the record's metrics under docs/metrics.md's names)."""
    out, cfg = job.result_dir, job.config
    out.mkdir(parents=True, exist_ok=True)
    loss_state = {k: v.detach().cpu().tolist() for k, v in loss.state_dict().items()}
    meta = {
        "stage": job.stage,
        "loss": resolve_loss(cfg.train, cfg.model.preset)[0],
        "loss_state": loss_state,
        **summary,
    }
    save_consolidated(out / "model.pt", state, cfg.model, manifest, meta)
    record = {**summary, "backoffs": result.backoffs}
    write_json(out / "record.json", record)
    history = {"epochs": result.history, "step_losses": result.step_losses}
    write_json(out / "history.json", history)
