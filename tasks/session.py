"""Open and close one pipeline run: layout, work-dir lock, run id, MLflow parent run, lineage.

Used by the Prefect flows and by `enn <stage>`. Under `dvc repro`, the stages of one `dvc`
process share a parent run (found by the group key of that process); in a batch job whose
script names its group (`ENN_RUN_GROUP`, deploy/slurm/), every `enn` command of the job (each
node's, each step's, each requeued run's) shares one.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from enn_core.config import RunConfig
from enn_core.errors import ConfigError
from enn_core.paths import Layout
from enn_core.stages import StageSpec
from tasks.lock import pipeline_lock
from tasks.runner import PipelineSession
from tasks.tracking.runs import ended_status


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


# How long a task that does not make its job's parent run waits for the one that does.
JOIN_WAIT_S = 120.0
# A batch job's run group, named by its script (deploy/slurm/*.sbatch: slurm-$SLURM_JOB_ID):
# the launcher-set variable of the job, never set by hand for an interactive allocation.
GROUP_ENV = "ENN_RUN_GROUP"
GROUP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


@dataclass(frozen=True)
class ParentGroup:
    """The MLflow parent run that several processes' stages share, found by its key (tag
    `enn.group`)."""

    key: str
    makes: bool = True  # this process makes the run when none exists; else waits for it
    run_dirs: bool = False  # the key is also the pipeline run's id (its folders in work/runs)

    @property
    def wait_s(self) -> float:
        return 0.0 if self.makes else JOIN_WAIT_S


def job_group() -> ParentGroup | None:
    """The parent run this process's pipeline joins: `dvc repro`'s, else its batch job's, else
    none (a parent of its own)."""
    return dvc_group() or batch_group()


def batch_group() -> ParentGroup | None:
    """Every `enn` command of one batch job (and of its requeued runs) under one parent run,
    when the job's script names the group (`ENN_RUN_GROUP=slurm-$SLURM_JOB_ID`: an `salloc`
    shell that runs several pipelines does not merge them). The job's first task makes it, so
    two nodes starting at once never make two: a worker started by torchrun (`RANK`: only
    global rank 0 records), else SLURM's task 0 or the batch script itself; the others wait
    for it (Tracker.start_parent: on a shared tracking store only)."""
    key = os.environ.get(GROUP_ENV, "")
    if not key:
        return None
    if not GROUP_NAME.fullmatch(key):
        raise ConfigError(
            f"{GROUP_ENV}={key[:40]!r} is not a run group name (letters, digits, '.', '_', "
            "'-'; at most 100): fix the batch script that sets it"
        )
    task = os.environ.get("SLURM_PROCID", "0")
    first = "RANK" in os.environ or not re.fullmatch(r"[0-9]+", task) or int(task) == 0
    return ParentGroup(key, makes=first)


def dvc_group() -> ParentGroup | None:
    """The key of the `dvc` process running this stage command (None outside `dvc repro`)."""
    if "DVC_STAGE" not in os.environ:
        return None
    proc = psutil.Process().parent()
    while proc is not None:
        try:
            argv = proc.cmdline()
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            break
        # `dvc ...` (console script) or `python -m dvc ...`
        names = [Path(a).name for a in argv[:3]]
        if "dvc" in names:
            return ParentGroup(f"dvc-{proc.pid}-{proc.create_time():.0f}", run_dirs=True)
        proc = proc.parent()
    return None


@contextlib.contextmanager
def pipeline_session(  # noqa: PLR0913  keyword options of the session every run opens
    cfg: RunConfig,
    config: Path,
    layout: Layout,
    name: str,
    *,
    run_id: str | None = None,
    tags: dict[str, str] | None = None,
    group: ParentGroup | None = None,
    specs: tuple[StageSpec, ...] = (),
) -> Iterator[PipelineSession]:
    """Lock the work directory, open the MLflow parent run (with the run's parameters), and
    close it with the right status, after adding the headline results of `specs`' outputs.

    `cfg` is the run's config, loaded once from `config` by the entry point."""
    root = layout.root
    with pipeline_lock(layout.lock_file, name):
        tracker = None
        if cfg.tracking.enabled:
            from tasks.tracking import Tracker, git_commit

            tracker = Tracker(cfg, layout)
            tracker.check_model_name(cfg, specs)  # another user's model: before any training
            lineage = {"enn.git_commit": git_commit(root), "enn.pipeline": name}
            tags = {**lineage, **(tags or {})}
        run_id = run_id or (group.key if group and group.run_dirs else new_run_id())
        parent = (
            tracker.start_parent(
                name,
                tags or {},
                group=group.key if group else None,
                cfg=cfg,
                data=data_name(cfg),
                wait_s=group.wait_s if group else 0.0,
            )
            if tracker
            else None
        )
        session = PipelineSession(
            cfg=cfg,
            config=Path(config).resolve(),
            layout=layout,
            run_id=run_id,
            tracker=tracker,
            parent_id=parent,
            tags={k: v for k, v in (tags or {}).items() if k.startswith(("enn.", "prefect."))},
            specs=specs,
        )
        try:
            yield session
        except BaseException as e:
            if tracker:
                # only what this run made or found up to date: a failed run must not show the
                # previous run's outputs (its dataset, its results) as its own
                done = tuple(s for s in specs if s.name in session.done)
                with contextlib.suppress(Exception):  # the stage's error is the one to report
                    tracker.summarize(parent, layout, done, session.registration)
                tracker.end(parent, ended_status(e), f"{type(e).__name__}: {e}")
            raise
        if tracker:
            tracker.summarize(parent, layout, specs, session.registration)
            tracker.end(parent, "FINISHED")


def data_name(cfg: RunConfig) -> str:
    """The data a run reads, in a word (`synthetic`, `speeds` for speeds.csv)."""
    if cfg.data.source == "synthetic" or not cfg.data.path:
        return cfg.data.source
    return Path(cfg.data.path).stem
