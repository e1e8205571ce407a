"""Run one stage: the same code path for the Prefect task, `enn <stage>` and `dvc repro`.

    execute_stage(stage, cfg, session)
      -> run dir (work/runs/<run-id>/<stage>/) with the resolved config
      -> MLflow child run (params of the sections the stage reads), events forwarded live
      -> the enn_core work function `run(cfg, ctx)`
      -> result.json in the run dir; the stage's resolved params beside its outputs

`PipelineSession` holds what one pipeline run shares: layout, run id, tracker, parent run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from enn_core.atomic import atomic_file, write_json
from enn_core.config import RunConfig, sections_of, to_plain
from enn_core.events import EventLog
from enn_core.fault import FaultInjector
from enn_core.paths import Layout
from enn_core.stage import StageContext
from tasks.registry import work_fn

log = logging.getLogger("enn")


@dataclass
class PipelineSession:
    layout: Layout
    run_id: str
    tracker: Any = None  # tasks.tracking.Tracker, or None when tracking is off
    parent_id: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    pipeline: str = "training"  # or "prediction": which work functions the stages run


@dataclass(frozen=True)
class StageResult:
    stage: str
    status: str  # "ran" or "skipped"
    reason: str
    summary: dict
    run_dir: str
    mlflow_run_id: str | None
    seconds: float
    work_seconds: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def write_resolved(cfg: RunConfig, run_dir: Path) -> Path:
    path = run_dir / "config.yaml"
    with atomic_file(path) as f:
        yaml.safe_dump(to_plain(cfg), f, sort_keys=False, allow_unicode=True)
    return path


def execute_stage(stage: str, cfg: RunConfig, session: PipelineSession) -> StageResult:
    t0 = time.perf_counter()
    layout = session.layout
    run_dir = layout.run_dir(session.run_id, stage)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = write_resolved(cfg, run_dir)
    ctx = StageContext(
        stage=stage,
        layout=layout,
        run_dir=run_dir,
        events=EventLog(run_dir),
        faults=FaultInjector(cfg.fault, marker_dir=layout.work / "faults"),
        progress=cfg.runtime.progress,
        logger=logging.getLogger(f"enn.{stage}"),
    )
    fn = work_fn(stage, session.pipeline)
    cfg = resolve_inputs(stage, cfg, run_dir)
    params = sections_of(cfg, stage)
    tracker = session.tracker
    child_cm = (
        tracker.child(stage, session.parent_id, run_dir, params, session.tags)
        if tracker
        else _null()
    )
    with child_cm as child_id:
        if tracker:
            tracker.log_artifact(child_id, config_path)
        w0 = time.perf_counter()
        error: BaseException | None = None
        try:
            ctx.faults.at(
                stage
            )  # the stage's own name is a fault phase (tests: raise, hang, kill...)
            summary = fn(cfg, ctx) or {}
        except BaseException as e:
            error = e
            raise
        finally:  # the diagnostics record names the cause, also (above all) when the stage failed
            write_diagnostics(run_dir, tracker, child_id, error)
        work_seconds = time.perf_counter() - w0
        out = layout.output(stage)
        if out.is_dir():
            write_json(out / "params.json", params)  # the resolved params beside the outputs
        publish_metrics(stage, out, summary, layout.root)
        write_json(run_dir / "result.json", summary)
        if tracker:
            tracker.log_artifact(child_id, run_dir / "result.json")
            tracker.set_tags(child_id, {"enn.work_seconds": f"{work_seconds:.3f}"})
            lineage = {
                k: v
                for k, v in session.tags.items()
                if k.startswith(("enn.git", "prefect.flow_run"))
            }
            lineage.update(lineage_of(summary))
            registry = tracker.after_stage(stage, child_id, layout, cfg, lineage, run_dir)
            if registry:
                summary = {**summary, "registry": registry}
    return StageResult(
        stage,
        "ran",
        "executed",
        summary,
        str(run_dir),
        child_id,
        time.perf_counter() - t0,
        work_seconds,
    )


def write_diagnostics(
    run_dir: Path, tracker, child_id: str | None, error: BaseException | None = None
) -> Path:
    """diagnostics.json + diagnostics.md in the run directory (choices, bottlenecks, non-finite
    tensors, OOM back-offs, worker phases, errors; the stage's own error and collapse-check's
    candidates); logged to the stage's MLflow run."""
    from enn_core.doctor import record

    diag = {**record.diagnostics(run_dir), **stage_findings(run_dir, error)}
    path = record.write(run_dir, diag)
    (run_dir / "diagnostics.md").write_text(findings_markdown(diag, record.markdown(diag)))
    if tracker:
        tracker.log_artifact(child_id, path)
        tracker.log_artifact(child_id, run_dir / "diagnostics.md")
    return path


CANDIDATE_MEASURES = (
    "spread_median",
    "spread_p10",
    "flat_fraction",
    "broadcast_fraction",
    "correlation_median",
    "mae",
)


def stage_findings(run_dir: Path, error: BaseException | None) -> dict[str, Any]:
    """What the stage said beyond the runtime's record: the error it failed with (the hung rank
    and phase, the export format and operator, why it collapsed) and, after collapse-check
    (its report.json beside the run's logs, also on failure), one row per candidate."""
    stage_error = (
        {"type": type(error).__name__, "message": str(error)} if error is not None else None
    )
    path = run_dir / "report.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    cands = report.get("candidates") if isinstance(report.get("candidates"), dict) else {}
    tried = [
        n for n in report.get("order") or [] if n in cands
    ]  # collapse.order: as they are tried
    rows = []
    for name in tried + [n for n in cands if n not in tried]:
        c = cands[name]
        m = c.get("measures") or {}
        failed = [k["measure"] for k in c.get("criteria") or [] if not k.get("ok")]
        rows.append(
            {
                "candidate": name,
                "status": c.get("status"),
                "distance": c.get("distance"),
                **{k: m.get(k) for k in CANDIDATE_MEASURES},
                "failed": ", ".join(failed) or c.get("reason") or "",
            }
        )
    return {"stage_error": stage_error, "candidates": rows}


def findings_markdown(diag: dict, md: str) -> str:
    """The record's markdown with the stage's error first and the candidates table last."""
    err = diag.get("stage_error")
    if err:
        line = f"- stage failed: {err['type']}: {err['message']}\n"
        md = md.replace("- nothing to report\n", "", 1).replace(
            "## Diagnostics\n\n", "## Diagnostics\n\n" + line, 1
        )
    rows = diag.get("candidates") or []
    if rows:
        cols = list(rows[0])
        md += (
            "\n### Collapse candidates\n\n| "
            + " | ".join(cols)
            + " |\n|"
            + " --- |" * len(cols)
            + "\n"
        )
        md += "".join("| " + " | ".join(_cell(r[c]) for c in cols) + " |\n" for r in rows)
    return md


def _cell(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else ("" if v is None else str(v).replace("|", "/"))


def resolve_inputs(stage: str, cfg: RunConfig, run_dir: Path) -> RunConfig:
    """A registered model reference (`models:/name@alias`, `runs:/...`) becomes a local folder
    holding its consolidated checkpoint and calibration, before enn_core sees the config."""
    if stage == "prepare-checkpoint":
        return _resolve_warm_start(cfg, run_dir)
    ref = cfg.predict.model
    if stage != "predict" or not ref.startswith(("models:/", "runs:/")):
        return cfg
    from tasks.tracking.models import resolve_model_uri

    local = resolve_model_uri(ref, run_dir / "model", cfg.tracking.uri or None)
    log.info("predict: %s resolved to %s", ref, local)
    return dataclasses.replace(
        cfg, predict=dataclasses.replace(cfg.predict, model=str(local / "model.pt"))
    )


def _resolve_warm_start(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """`checkpoint.init_from: models:/name@alias` -> the registered version's folder (with a
    SOURCE file naming the URI, which prepare-checkpoint records as the warm start's source)."""
    ref = cfg.checkpoint.init_from
    if not ref.startswith(("models:/", "runs:/")):
        return cfg
    from tasks.tracking.models import materialize

    local = materialize(ref, run_dir / "init_source", cfg.tracking.uri or None).parent
    log.info("prepare-checkpoint: warm start %s resolved to %s", ref, local)
    return dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, init_from=str(local))
    )


def lineage_of(summary: dict) -> dict[str, str]:
    """World size and checkpoint step, when a stage reports them."""
    out = {}
    for key in ("world_size", "checkpoint_step", "step", "global_step"):
        if key in summary and isinstance(summary[key], (int, float, str)):
            out[f"enn.{'checkpoint_step' if key in ('step', 'global_step') else key}"] = str(
                summary[key]
            )
    return out


def publish_metrics(stage: str, out: Path, summary: dict, root: Path) -> None:
    """Copy a stage's metrics and plot data where dvc.yaml declares them (outside the
    stage's output directory, since DVC forbids overlapping outputs)."""
    metrics = out / "metrics.json"
    data = json.loads(metrics.read_text()) if metrics.exists() else summary.get("metrics")
    if data is not None:
        write_json(root / "outputs" / "metrics" / f"{stage}.json", data)
    history = out / "history.json"
    if history.exists():
        write_json(root / "outputs" / "plots" / f"{stage}.json", json.loads(history.read_text()))


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
