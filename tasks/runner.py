"""Run one stage: the same code path for the Prefect task, `enn <stage>` and `dvc repro`.

    execute_stage(spec, cfg, session)
      -> run dir (work/runs/<run-id>/<stage>/) with the resolved config
      -> MLflow child run (params of the sections the stage reads), events forwarded live
      -> registered-model references in the config resolved to local folders (spec.model_refs)
      -> the spec's enn_core work function `work(cfg, ctx)`
      -> result.json in the run dir; the stage's resolved params beside its outputs

Nothing here knows a particular stage: what differs between stages is in their specs
(enn_core/stages/). `PipelineSession` holds what one pipeline run shares: layout, run id,
tracker, parent run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import yaml

from enn_core.atomic import atomic_file, write_json
from enn_core.config import RunConfig, replace_key, sections_of, to_logged
from enn_core.errors import ConfigError, OutOfMemory, StaleOutputError, out_of_memory
from enn_core.events import EventLog
from enn_core.fault import FaultInjector
from enn_core.model_code import check_dvc_deps
from enn_core.paths import Layout
from enn_core.stage import StageContext
from enn_core.stages import TRAINING, StageSpec
from enn_core.summaries import StageSummary
from tasks.warm import after_stage, before_stage

if TYPE_CHECKING:
    from tasks.tracking import Tracker
    from tasks.tracking.registry import Registration

log = logging.getLogger("enn")


@dataclass
class PipelineSession:
    """What the stages of one pipeline run share: its config (loaded once), the config file it
    came from (DVC owns staleness only for the pipeline's params.yaml), layout, run id, tracker
    and MLflow parent run."""

    cfg: RunConfig
    config: Path
    layout: Layout
    run_id: str
    tracker: Tracker | None = None  # None when tracking is off
    parent_id: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    registration: Registration | None = None  # set by the stage that registers the model
    done: list[str] = field(default_factory=list)  # stages that ran or were up to date here
    one_off: str = ""  # why DVC neither skips nor records this run ("" when it may)
    specs: tuple[StageSpec, ...] = ()  # the run's stages, in order (tasks/warm.py)


@dataclass(frozen=True)
class StageResult:
    """What running (or skipping) one stage gave: the flows, the CLI and Prefect read it."""

    stage: str
    status: Literal["ran", "skipped"]
    reason: str
    summary: StageSummary | None  # None when skipped
    run_dir: str
    mlflow_run_id: str | None
    seconds: float
    work_seconds: float
    registry: Registration | None = None  # the registered model (a registering stage)


@dataclass
class FlowRecord:
    """What a flow run did so far, filled in as it goes (flows/training.py), for `enn run`'s
    closing summary (flows/summary.py): also when the flow fails or is cancelled, returning
    nothing."""

    results: dict[str, StageResult] = field(default_factory=dict)
    running: str | None = None  # the stage under way (the one a failure or a cancel stopped)
    running_since: float = 0.0  # time.monotonic() when it started
    flow_run_id: str | None = None
    mlflow_experiment_id: str | None = None
    mlflow_run_id: str | None = None  # the pipeline's parent run
    params: str | None = None  # which config file `--set` changed, or that none did


def write_resolved(cfg: RunConfig, run_dir: Path) -> Path:
    path = run_dir / "config.yaml"
    with atomic_file(path) as f:
        yaml.safe_dump(to_logged(cfg), f, sort_keys=False, allow_unicode=True)
    return path


def make_stage_context(
    spec: StageSpec, cfg: RunConfig, layout: Layout, run_dir: Path
) -> StageContext:
    return StageContext(
        spec=spec,
        layout=layout,
        run_dir=run_dir,
        events=EventLog(run_dir),
        faults=FaultInjector(cfg.fault, marker_dir=layout.work / "faults"),
        progress=cfg.runtime.progress,
        logger=logging.getLogger(f"enn.{spec.name}"),
        progress_every_s=cfg.runtime.progress_every_s,
    )


def check_inputs(spec: StageSpec, layout: Layout) -> None:
    """Every stage this one reads has written its output folder."""
    missing = [s for s in spec.inputs if not s.output_dir(layout).is_dir()]
    if missing:
        first = missing[0]
        raise StaleOutputError(
            f"{first.output_dir(layout)} is missing; run {first.name} before {spec.name}"
        )


def check_model_code(spec: StageSpec, session: PipelineSession) -> None:
    """A custom model's code is a dependency of the stages that build it in the pipeline's
    dvc.yaml (an overlay config keeps DVC out, and so is not checked)."""
    model = session.cfg.model
    root = session.layout.root
    pipeline_params = session.config.resolve() == (root / "params.yaml").resolve()
    if "model" in spec.sections and model.preset == "custom" and pipeline_params:
        builds = [s.dvc_name for s in TRAINING if "model" in s.sections]
        check_dvc_deps(model.factory, root, root / "dvc.yaml", builds)


def execute_stage(spec: StageSpec, session: PipelineSession) -> StageResult:
    t0 = time.perf_counter()
    cfg = session.cfg
    layout = session.layout
    run_dir = layout.run_dir(session.run_id, spec.name)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = write_resolved(cfg, run_dir)
    ctx = make_stage_context(spec, cfg, layout, run_dir)
    check_inputs(spec, layout)
    check_model_code(spec, session)
    cfg = resolve_model_refs(spec, cfg, run_dir, layout)
    params = sections_of(cfg, spec.sections)
    tracker = session.tracker
    registry: Registration | None = None
    child_cm = (
        tracker.child(spec.name, session.parent_id, run_dir, params, session.tags)
        if tracker
        else _null()
    )
    with child_cm as child_id:
        if tracker:
            tracker.log_artifact(child_id, config_path)
        w0 = time.perf_counter()
        error: BaseException | None = None
        before_stage(spec, session.specs, plots=tracker is not None)
        try:
            summary = run_work(spec, cfg, ctx)
        except BaseException as e:
            error = e
            if tracker:
                end_stopped(tracker, spec.name, child_id, session.parent_id, e)
            raise
        finally:  # the diagnostics record names the cause, also (above all) when it failed
            after_stage(spec)
            write_diagnostics(run_dir, tracker, child_id, error)
        work_seconds = time.perf_counter() - w0
        out = spec.output_dir(layout)
        # a node without global rank 0 publishes nothing: not outputs/, not the tracker's
        published = not summary.node_only
        if published and out.is_dir():
            write_json(out / "params.json", params)  # the resolved params beside the outputs
        if published:
            publish_metrics(spec, layout)
        write_json(run_dir / "result.json", summary.as_dict())
        if tracker and published:
            tracker.log_artifact(child_id, run_dir / "result.json")
            tracker.set_tags(child_id, {"enn.work_seconds": f"{work_seconds:.3f}"})
            lineage = {
                k: v
                for k, v in session.tags.items()
                if k.startswith(("enn.git", "prefect.flow_run"))
            }
            lineage.update(summary.lineage())
            registry = tracker.after_stage(spec, child_id, layout, cfg, lineage, run_dir)
            if registry is not None:
                session.registration = registry
                # the version and why, one line, in every command that registers (`enn export`
                # and `dvc repro` print no summary); a version made champion without passing
                # the rule is a warning
                (log.warning if registry.warning else log.info)(
                    "%s: %s", spec.name, registry.line()
                )
    session.done.append(spec.name)
    return StageResult(
        spec.name,
        "ran",
        "executed",
        summary,
        str(run_dir),
        child_id,
        time.perf_counter() - t0,
        work_seconds,
        registry,
    )


def run_work(spec: StageSpec, cfg: RunConfig, ctx: StageContext) -> StageSummary:
    """The stage's work; running out of memory (numpy's MemoryError, torch's allocators, a
    worker's, a worker the kernel killed) becomes its one line: the stage, what it tried to
    hold and the settings that lower it (`spec.memory`), with its own exit code."""
    try:
        ctx.faults.at(spec.name)  # the stage's name is a fault phase (tests: raise, hang...)
        return spec.work(cfg, ctx)
    except (MemoryError, RuntimeError, OSError, OutOfMemory) as e:
        oom = out_of_memory(e, spec.name, spec.memory)
        if oom is None:
            raise
        raise oom from e


def refuse_other_rank(spec: StageSpec, rank: int) -> None:
    """Under an external launcher, a process other than global rank 0 runs only the stages
    whose work every rank shares (`spec.every_rank`); any other would write outputs/."""
    if not spec.every_rank:
        raise ConfigError(
            f"{spec.name} runs on global rank 0 alone (it publishes outputs/), and this process "
            f"is rank {rank} of an external launcher (runtime.launcher=external, RANK={rank}); "
            "run it without the launcher, or only on rank 0"
        )


def write_diagnostics(
    run_dir: Path, tracker: Tracker | None, child_id: str | None, error: BaseException | None
) -> Path:
    """diagnostics.json + diagnostics.md in the run directory (choices, bottlenecks, non-finite
    tensors, OOM back-offs, worker phases, the tables a stage recorded, and the stage's own
    error); logged to the stage's MLflow run."""
    from enn_core import diagnostics as record  # not the doctor's package: its layers import DCP

    diag = record.diagnostics(run_dir)
    if error is not None:
        diag["stage_error"] = {"type": type(error).__name__, "message": str(error)}
    path = record.write(run_dir, diag)
    (run_dir / "diagnostics.md").write_text(record.markdown(diag))
    if tracker:
        tracker.log_artifact(child_id, path)
        tracker.log_artifact(child_id, run_dir / "diagnostics.md")
    return path


def resolve_model_refs(spec: StageSpec, cfg: RunConfig, run_dir: Path, layout: Layout) -> RunConfig:
    """A registered model reference (`models:/name@alias`, `runs:/...`, `champion` for this
    task's champion) in one of the spec's
    `model_refs` keys becomes a local folder holding its consolidated checkpoint, calibration
    and sidecar (with a SOURCE file naming the reference), before enn_core sees the config."""
    for key in spec.model_refs:
        section, name = key.split(".")
        from tasks.tracking.models import expand, materialize

        ref = expand(str(getattr(getattr(cfg, section), name)), cfg, layout.root)
        if not ref.startswith(("models:/", "runs:/")):
            continue

        local = materialize(ref, run_dir / "models" / name, cfg.tracking.uri or None)
        log.info("%s: %s resolved to %s", spec.name, ref, local)
        cfg = replace_key(cfg, key, str(local))
    return cfg


def publish_metrics(spec: StageSpec, layout: Layout) -> None:
    """Copy a stage's metrics and plot data where dvc.yaml declares them (outside the
    stage's output directory, since DVC forbids overlapping outputs)."""
    out = spec.output_dir(layout)
    metrics = out / "metrics.json"
    if spec.metrics and metrics.exists():
        values = json.loads(metrics.read_text())
        write_json(
            layout.outputs / "metrics" / f"{spec.name}.json",
            {k: values[k] for k in spec.metrics if k in values},
        )
    history = out / "history.json"
    if history.exists():
        write_json(layout.outputs / "plots" / f"{spec.name}.json", json.loads(history.read_text()))


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> Literal[False]:
        return False


def end_stopped(
    tracker: Tracker, stage: str, run_id: str | None, parent_id: str | None, e: BaseException
) -> None:
    """A stage stopped from outside (`ended_status` KILLED: SIGTERM, Ctrl-C, a preempted or
    cancelled batch job): its run and the parent KILLED at once, before the diagnostics are
    logged. The scheduler's SIGKILL (SLURM's KillWait) may end the process seconds later: a
    cancelled SLURM job's parent stayed RUNNING until the next job's `sweep_killed` (issue
    54). `Tracker.child` ends them again, with the error, when there is time."""
    from tasks.tracking.runs import ended_status

    if ended_status(e) != "KILLED":
        return
    msg = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    with contextlib.suppress(Exception):  # the stop is what the process reports
        tracker.end(parent_id, "KILLED", f"stage {stage} stopped: {msg}")
        tracker.end(run_id, "KILLED", msg)
