"""The distributed-train stage: launch the workers, publish their outputs atomically.

    run(cfg, ctx) -> summary

Reads the staged data (`outputs/stage-data/`) and the initial checkpoint
(`outputs/prepare-checkpoint/init.pt`); launches `runtime.world_size` workers (0 = the number
of GPUs, 1 on CPU) through the project's launcher (torchrun in a child process group,
enn_core.runtime.launch), at world size 1 too, so there is one code path;
writes `outputs/distributed-train/{model.pt, record.json, metrics.json, history.json}` (the
workers' record; its numbers under docs/metrics.md's names; the curves) in one atomic
directory replace. Per-rank logs, heartbeats, stack dumps and error records stay in the run
directory (`ctx.run_dir`), whose `events.jsonl` rank 0 appends its metrics to.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from enn_core.atomic import atomic_dir, not_a_link, read_plain, write_json
from enn_core.config import RunConfig
from enn_core.data.dataset import StagedDataset
from enn_core.errors import (
    ConfigError,
    EnnError,
    NoSpaceError,
    StaleOutputError,
    WorkerError,
    low_space,
)
from enn_core.metric_names import telemetry, train_summary
from enn_core.progress import follow_training
from enn_core.runtime.device import threads_per_worker
from enn_core.runtime.external import LauncherEnv
from enn_core.runtime.heartbeat import read_heartbeats, stale_temp_files
from enn_core.runtime.launch import Rendezvous, launch, read_errors
from enn_core.runtime.watchdog import FIRST_FORWARD, first_forward_budget
from enn_core.stage import StageContext
from enn_core.summaries import TrainSummary
from enn_core.train.batch import choose_batch, total_steps, with_batch
from enn_core.train.ckpt import (
    COMMITTED,
    COMPLETE,
    LINK_FIX,
    committed,
    corrupt_files,
    step_name,
)
from enn_core.train.fingerprint import Fingerprint, diff, fingerprint
from enn_core.train.job import JOB_FILE, SHARED_OUTPUTS, CheckpointPlan, WorkerJob

WORKER_OUTPUTS = ("model.pt", "record.json", "history.json")
WORKER_ENTRY = "enn_core.train.worker:main"
OUTPUTS = (*WORKER_OUTPUTS, "metrics.json")


def resolve_world_size(requested: int, device: str) -> tuple[int, str]:
    """(world size, reason): 0 means one worker per GPU, or 1 on CPU."""
    if requested > 0:
        return requested, f"runtime.world_size={requested}"
    if device != "cpu" and torch.cuda.is_available():
        n = torch.cuda.device_count()
        return n, f"runtime.world_size=0: one worker per GPU ({n})"
    return 1, "runtime.world_size=0 on CPU: 1 worker"


def run(cfg: RunConfig, ctx: StageContext, *, staged: Path, init: Path) -> TrainSummary:
    """Train on the staged data (`staged`) from the initial checkpoint in `init`."""
    init = init / "init.pt"
    for path in (staged / "manifest.json", init):
        if not path.exists():
            raise StaleOutputError(f"{path} is missing; run {path.parent.name} first")
    world, why = resolve_world_size(cfg.runtime.world_size, cfg.runtime.device)
    threads = threads_per_worker(cfg.runtime.threads_per_worker, world)
    result_dir = ctx.run_dir / "result"
    shutil.rmtree(result_dir, ignore_errors=True)
    data = StagedDataset(staged)
    rows = len(data.split("train"))
    batch = choose_batch(cfg.train.batch_size, rows, world)
    cfg = with_batch(cfg, batch)  # the job and the fingerprint hold the number
    fp = fingerprint(cfg, data.fingerprint)
    job = WorkerJob(
        config=cfg,
        staged=staged,
        init=init,
        run_dir=ctx.run_dir,
        result_dir=result_dir,
        threads=threads,
        marker_dir=ctx.faults.marker_dir or ctx.run_dir,
        stage=ctx.stage,
        checkpoint=checkpoint_spec(cfg, ctx, fp),
        root=ctx.layout.root,
    )
    job_path = job.write(ctx.run_dir / JOB_FILE)
    ctx.events.param("runtime.world_size", world)
    ctx.events.param("runtime.world_size_reason", why)
    ctx.logger.info("distributed-train: %d worker(s) (%s), %d thread(s) each", world, why, threads)
    if batch.reason != f"train.batch_size={batch.value}":  # chosen, not set: say why
        ctx.events.param("train.batch_size_reason", batch.reason)
        ctx.logger.info("distributed-train: batch %d (%s)", batch.value, batch.reason)
    t0 = time.time()
    total = total_steps(cfg.train, max(1, -(-rows // batch.value))) if rows else None
    workers: dict[str, Any] = {}
    try:
        with (
            follow_training(
                ctx.run_dir,
                total,
                ctx.stage,
                ctx.logger,
                ctx.progress,
                every_s=cfg.runtime.progress_every_s,
                epochs=cfg.train.epochs,
            ),
            no_space_named(ctx, job),
        ):
            results = start_workers(cfg, ctx, job_path, world, init)
    except Exception:
        forward_logs(ctx)  # the ranks' last lines beside the error (Prefect's task log)
        raise
    finally:
        try:
            workers = record_workers(ctx)
        except OSError as e:  # a full disk: the run record cannot take more
            ctx.logger.warning("%s: the workers' phases were not recorded (%s)", ctx.stage, e)
    if 0 not in results:  # another node hosted global rank 0: it writes model.pt
        ctx.logger.info(
            "distributed-train: this node ran ranks %s; model.pt is written on the node of rank 0",
            sorted(results),
        )
        publish_shared(ctx, job)
        return TrainSummary(
            record={
                "node_ranks": sorted(int(r) for r in results),
                "ranks": {int(r): v for r, v in sorted(results.items())},
            },
            wall_s=time.time() - t0,
            nodes=cfg.runtime.nnodes,
            node_only=True,
        )
    summary = {**results[0], **workers}  # restarts and phases: MLflow, Prefect and dvc metrics
    summary["ranks"] = {int(r): v for r, v in sorted(results.items())}
    record_checkpoints(ctx, summary.get("checkpoint") or {}, fp)
    if (summary.get("checkpoint") or {}).get("saved_positions"):
        summary["checkpoint_step"] = summary["checkpoint"]["saved_positions"][-1]
    with atomic_dir(ctx.output()) as tmp:
        for name in WORKER_OUTPUTS:
            shutil.copy2(result_dir / name, tmp / name)
        record = {**json.loads((tmp / "record.json").read_text()), **workers}
        # each rank's peak anonymous memory per phase (MiB; enn_core.runtime.memory_limit)
        record["anon_peak_mib"] = {str(r): v.get("anon_peak_mib") for r, v in results.items()}
        write_json(tmp / "record.json", record)
        metrics = {**train_summary(record), "train/wall_s": time.time() - t0}
        write_json(tmp / "metrics.json", metrics)
    ctx.events.metrics(metrics)
    return TrainSummary(
        output=str(ctx.output()),
        nodes=cfg.runtime.nnodes,
        record=summary,
        metrics=metrics,
        outputs=tuple(str(ctx.output() / n) for n in OUTPUTS),
        wall_s=metrics["train/wall_s"],
        logs=str(ctx.run_dir / "logs"),
    )


def publish_shared(ctx: StageContext, job: WorkerJob) -> None:
    """On a node without global rank 0: the outputs rank 0 put into the shared checkpoint
    folder (enn_core.train.worker.share_outputs), published in this checkout too, so this node
    holds the same model.pt as rank 0's (a prediction across the nodes needs it on each)."""
    launched = LauncherEnv.from_env()  # under torchrun: one process per node publishes
    if launched is not None and launched.local_rank != 0:
        return
    shared = job.checkpoint.dir / SHARED_OUTPUTS if job.checkpoint else None
    if shared is None or not all((shared / n).is_file() for n in WORKER_OUTPUTS):
        return
    not_a_link(shared, "remove the link, or choose another checkpoint.dir")
    for name in WORKER_OUTPUTS:  # a link there would choose which file is published here
        read_plain(shared / name).close()
    with atomic_dir(ctx.output()) as tmp:
        for name in WORKER_OUTPUTS:
            shutil.copy2(shared / name, tmp / name)
        record = json.loads((tmp / "record.json").read_text())
        write_json(tmp / "metrics.json", train_summary(record))
    ctx.logger.info(
        "distributed-train: published rank 0's model.pt from %s in %s", shared, ctx.output()
    )


def start_workers(
    cfg: RunConfig, ctx: StageContext, job_path: Path, world: int, init: Path
) -> dict[int, Any]:
    """The workers' summaries by global rank: `world` elastic workers of this node, or, under
    an external launcher, this process as the one worker the launcher started. `init`: the
    initial checkpoint, whose size sets the first step's budget."""
    if cfg.runtime.launcher == "external":
        return run_here(job_path, ctx)
    if os.environ.get("TORCHELASTIC_RUN_ID") and LauncherEnv.from_env() is not None:
        raise ConfigError(
            "distributed-train is running inside a worker that a launcher started "
            f"(TORCHELASTIC_RUN_ID={os.environ['TORCHELASTIC_RUN_ID']}) and would start workers "
            "of its own; give the launcher this project's worker entry instead: "
            "`torchrun ... -m flows.worker` (docs/scale-out.md)"
        )
    return launch(
        WORKER_ENTRY,  # imported by the worker only (it pulls DCP in)
        (str(job_path),),
        nprocs=world,
        run_dir=ctx.run_dir,
        hang_timeout_s=cfg.runtime.hang_timeout_s,
        max_restarts=cfg.runtime.max_restarts,
        budgets=phase_budgets(cfg, ctx, init.stat().st_size),
        timeout_s=cfg.runtime.task_timeout_s,
        cancel=ctx.cancel,
        rdzv=Rendezvous.of(cfg.runtime),
    )


def phase_budgets(cfg: RunConfig, ctx: StageContext, model_bytes: int) -> dict[str, float]:
    """The watchdog's phase budgets (runtime.*_budget_s); the first step's grows with the
    model (`first_forward_budget`) and, where that adds a second or more to
    runtime.hang_timeout_s, is logged and recorded with its reason."""
    rt = cfg.runtime
    first, why = first_forward_budget(rt.hang_timeout_s, model_bytes, rt.first_forward_s_per_gb)
    if first - rt.hang_timeout_s >= 1.0:
        ctx.events.param("runtime.first_forward_budget_s", round(first, 1))
        ctx.events.param("runtime.first_forward_budget_reason", why)
        ctx.logger.info(
            "distributed-train: the first step's hang budget is %.0f s (%s)", first, why
        )
    return {
        "spawn": rt.spawn_budget_s,
        "compile": rt.compile_budget_s,
        "checkpoint": rt.checkpoint_budget_s,
        FIRST_FORWARD: first,
    }


def run_here(job_path: Path, ctx: StageContext) -> dict[int, Any]:
    """The training worker in this process (the launcher set RANK, WORLD_SIZE, ...); it
    restarts the job, not us. A library error becomes one line naming the rank and phase."""
    launched = LauncherEnv.required()
    try:
        from enn_core.train import worker

        return {launched.rank: worker.main(str(job_path))}
    except (EnnError, KeyboardInterrupt):
        raise
    except Exception as e:
        recs = read_errors(ctx.run_dir)
        where = f" in phase {recs[-1]['phase']}" if recs else ""
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise WorkerError(
            f"rank {launched.rank} failed{where}: {type(e).__name__}: {first} "
            f"(log: {ctx.run_dir / 'logs' / f'rank-{launched.rank}.log'}); the launcher "
            "restarts the job if --max-restarts allows"
        ) from e


@contextlib.contextmanager
def no_space_named(ctx: StageContext, job: WorkerJob) -> Iterator[None]:
    """A launch that failed on a full disk is a NoSpaceError naming the path and its free
    space (the workers, unable to write their heartbeats and error records, looked hung; their
    saves died mid-write); the half-written checkpoint and heartbeat temp files are swept."""
    try:
        yield
    except Exception as e:
        roots = [ctx.run_dir, *([job.checkpoint.dir] if job.checkpoint else [])]
        full = low_space(roots)
        if full is None and not _is_no_space(e):
            raise
        error = NoSpaceError.at(full or ctx.run_dir, "checkpoints and worker records")
        sweep_temp(ctx, job)  # after measuring: the message tells how full it was
        raise error from e


def _is_no_space(e: BaseException) -> bool:
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def sweep_temp(ctx: StageContext, job: WorkerJob) -> None:
    """Remove the temp files a failed launch leaves: half-written checkpoints, heartbeats."""
    if job.checkpoint is not None:
        for tmp in Path(job.checkpoint.dir).glob(".tmp-step-*"):
            shutil.rmtree(tmp, ignore_errors=True)
    for tmp in ctx.run_dir.rglob(".tmp-*"):
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
    for tmp in stale_temp_files(ctx.run_dir):  # named after the heartbeat file, not .tmp-*
        tmp.unlink(missing_ok=True)


def record_workers(ctx: StageContext) -> dict[str, Any]:
    """Each rank's last phase and attempt, and the per-rank logs, into the run record; returns
    {"restarts": n, "rank_phases": {"<rank>": phase}} for the stage's summary and metrics."""
    beats = read_heartbeats(ctx.run_dir)
    phases = {str(r): h.get("phase") for r, h in sorted(beats.items())}
    for r, phase in phases.items():
        ctx.events.param(f"workers.rank{r}_phase", phase)
    for log in sorted(Path(ctx.run_dir, "logs").glob("rank-*.log")):
        ctx.events.artifact(log, "logs")
    if not beats:
        return {}
    restarts = max(int(h.get("attempt", 0)) for h in beats.values())
    ctx.events.param("workers.restarts", restarts)
    return {"restarts": restarts, "rank_phases": phases}


def forward_logs(ctx: StageContext, tail: int = 20) -> None:
    """After a failure: the last lines of each rank's log, at DEBUG (the log file, Prefect's
    task log with --verbose); the error itself names the rank and its phase."""
    for log in sorted(Path(ctx.run_dir, "logs").glob("rank-*.log")):
        lines = log.read_text(errors="replace").splitlines()[-tail:]
        for line in lines:
            ctx.logger.debug("%s: %s", log.stem, line)


def checkpoint_spec(cfg: RunConfig, ctx: StageContext, fp: Fingerprint) -> CheckpointPlan:
    """The job's checkpoint directory (keyed by the fingerprint) and what to start from.

    An explicit `checkpoint.resume_from` must carry the same fingerprint (the difference is
    named otherwise) unless `checkpoint.warm_start` asks for its weights only."""
    base = ctx.layout.resolve(cfg.checkpoint.dir) if cfg.checkpoint.dir else ctx.layout.checkpoints
    root = base / fp.digest
    not_a_link(root, LINK_FIX)
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "fingerprint.json").exists():
        write_json(root / "fingerprint.json", {"digest": fp.digest, **fp.parts})
    plan = CheckpointPlan(dir=root, digest=fp.digest)
    source = cfg.checkpoint.resume_from
    if source:
        path = ctx.layout.resolve(source)
        if not (path / COMMITTED).is_file():
            raise ConfigError(
                f"checkpoint.resume_from={source}: {path} is not a committed checkpoint "
                f"(no {COMMITTED} marker); pick a step-* directory under {base}"
            )
        if bad := corrupt_files(path):
            raise ConfigError(
                f"checkpoint.resume_from={source}: {', '.join(bad)} no longer match the hashes "
                f"its {COMMITTED} recorded (a corrupt copy); pick another checkpoint"
            )
        theirs = _read_fp(path.parent)
        if theirs.get("digest") != fp.digest and not cfg.checkpoint.warm_start:
            named = "; ".join(diff({k: v for k, v in theirs.items() if k != "digest"}, fp.parts))
            raise ConfigError(
                f"checkpoint.resume_from={source} was written by another run "
                f"({named or 'unknown fingerprint'}); "
                "resume needs the same data, data/model/train config and torch version; set "
                "checkpoint.warm_start=true to start from its weights only"
            )
        plan = replace(plan, resume_from=path, weights_only=theirs.get("digest") != fp.digest)
    elif cfg.checkpoint.resume and not committed(root):
        explain_no_resume(ctx, base, fp)
    return plan


def _read_fp(root: Path) -> dict:
    try:
        return json.loads((root / "fingerprint.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def explain_no_resume(ctx: StageContext, base: Path, fp: Fingerprint) -> None:
    """Log why the newest interrupted run is not resumed: its fingerprint differs."""
    others = [
        d
        for d in ctx.layout.checkpoints.glob("*")
        if d.is_dir() and d.name != fp.digest and committed(d) and not (d / COMPLETE).exists()
    ]
    if not others:
        return
    newest = max(others, key=lambda d: committed(d)[-1].stat().st_mtime)
    theirs = {k: v for k, v in _read_fp(newest).items() if k != "digest"}
    ctx.logger.info(
        "distributed-train: not resuming the interrupted run in %s, its fingerprint differs (%s); "
        "starting fresh",
        newest,
        "; ".join(diff(theirs, fp.parts)) or "unknown",
    )


def record_checkpoints(ctx: StageContext, info: dict, fp: Fingerprint) -> None:
    """Resume source, checkpoint steps and the fingerprint into the run record (MLflow)."""
    ctx.events.param("checkpoint.fingerprint", fp.digest)
    ctx.events.param("checkpoint.dir", info.get("dir", ""))
    ctx.events.param("checkpoint.resumed_from", info.get("resumed_from") or "fresh")
    for moved in info.get("quarantined") or []:
        ctx.logger.warning("%s: a corrupt checkpoint was moved to %s", ctx.stage, moved)
    if info.get("quarantined"):
        ctx.events.param("checkpoint.quarantined", ",".join(info["quarantined"])[:500])
    saved = info.get("saved_positions") or []
    ctx.events.param("checkpoint.saved", ",".join(step_name(p) for p in saved)[:500] or "none")
    if saved:
        ctx.events.metrics(
            {
                telemetry("checkpoint/last_step"): float(saved[-1]),
                telemetry("checkpoint/count"): float(len(saved)),
            }
        )
