"""The collapse-check stage: find prediction collapse and its cause, and never hide it.

ENN-PyTorch shipped one 39 x 24 map repeated for all 168 groups. This stage measures the
model's predictions on the validation rows (enn_core/collapse/measures.py), compares the
candidate prediction paths side by side (candidates.py) and records the choice.

Outputs (its output folder, replaced atomically as one directory):
- passed: `report.json` (every candidate, how far each was from passing, the cause, the chosen
  candidate's validation metrics), `calibration.json` (+ `slope.npy`/`intercept.npy` for the
  calibrated candidate), `metrics.json`, and `reference.npy`: the raw features of up to 64 of
  the validation rows checked, which travel with the registered model so that the prediction
  flow can judge a batch of a few rows beside them (enn_core/collapse/reference.py).
- all collapsed: `report.json`, `reference.npy` and a `FAILED` marker, no `calibration.json`;
  then the stage raises
  CollapseError. A previous passing output is replaced, so export (which requires
  calibration.json and refuses on FAILED) can never ship a stale calibration.

The candidates table also goes into the run's diagnostics record (a `table` event).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import numpy as np

from enn_core.atomic import atomic_dir, write_json
from enn_core.checkpoint import Checkpoint
from enn_core.collapse.candidates import CheckRows, check_candidates, run_precision
from enn_core.collapse.reference import write_reference
from enn_core.collapse.report import REPORT_FILE, CollapseReport, verdict_lines
from enn_core.config import RunConfig
from enn_core.data.dataset import StagedDataset
from enn_core.data.label_mode import label_mode
from enn_core.errors import CollapseError, StaleOutputError
from enn_core.inference import (
    CALIBRATION_FILE,
    FAILED_MARKER,
    MODEL_FILE,
    label_std,
    load_trained,
    resolve_device,
    sha256_file,
    write_calibration,
)
from enn_core.metrics import NaiveModel
from enn_core.model.enn import ENN
from enn_core.model_code import BUILTIN, ModelCode
from enn_core.stage import StageContext
from enn_core.summaries import CollapseSummary

MEASURES = (
    "spread_median",
    "spread_p10",
    "flat_fraction",
    "broadcast_fraction",
    "correlation_median",
    "mae",
)


def flat_metrics(report: CollapseReport) -> dict[str, float]:
    """Numbers for `dvc metrics show` and MLflow: pass/fail, each candidate's measures, the
    choice."""
    out = {"collapse/passed": float(report.status == "passed")}
    for name, c in report.candidates.items():
        if c.status == "not_applicable":
            continue
        vals = {**c.measures, "distance": c.distance}
        for key in (*MEASURES, "distance"):
            v = vals.get(key)
            if v is not None and math.isfinite(v):
                out[f"collapse/{name}/{key}"] = float(v)
    for k, v in (report.chosen_metrics or {}).items():
        if math.isfinite(v):
            out[f"collapse/chosen/{k}"] = float(v)
    return out


def candidate_rows(report: CollapseReport) -> list[dict[str, str | float | None]]:
    """One row per candidate, in the order they are tried: status, how far from passing, the
    measures and what failed (the diagnostics record, the Prefect table)."""
    tried = [n for n in report.order if n in report.candidates]
    rows = []
    for name in tried + [n for n in report.candidates if n not in tried]:
        c = report.candidates[name]
        failed = ", ".join(k.measure for k in c.criteria if not k.ok)
        rows.append(
            {
                "candidate": name,
                "status": c.status,
                "distance": c.distance if c.status != "not_applicable" else None,
                **{k: c.measures.get(k) for k in MEASURES},
                "failed": failed or c.reason,
            }
        )
    return rows


def check_rows(  # noqa: PLR0913
    ds_path: Path,
    trained: Path,
    stage: str,
    max_rows: int,
    code: ModelCode = BUILTIN,
    chunk_rows: int | None = None,
) -> tuple[StagedDataset, ENN, Checkpoint, CheckRows]:
    """(dataset, model, checkpoint, CheckRows) of the validation rows (sampled to max_rows)."""
    ds, model, ckpt = load_trained(ds_path, trained, stage, code)
    return ds, model, ckpt, validation_rows(ds, stage, max_rows, chunk_rows)


def validation_rows(
    ds: StagedDataset, stage: str, max_rows: int, chunk_rows: int | None = None
) -> CheckRows:
    """The validation rows (sampled to max_rows) with their naive predictions, the training
    labels' std and, read when needed, their majority value per output (in chunks)."""
    val = np.asarray(ds.split("val"))
    if len(val) > max_rows:  # the per-sample candidate runs one row at a time
        val = np.sort(np.random.default_rng(0).choice(val, max_rows, replace=False))
    if len(val) < 2:
        raise StaleOutputError(
            f"splits/val.npy has {len(val)} rows; {stage} needs >= 2: re-run "
            f"{ds.path.name} with a larger data.val_fraction"
        )
    manifest = ds.manifest
    return CheckRows(
        features=np.asarray(ds.features[val], dtype=np.float32),
        target=np.asarray(ds.targets[val]),
        naive=NaiveModel(ds, chunk_rows).predict(val),
        label_std=label_std(ds, chunk_rows),
        axes=manifest.label_axes,
        axis_values=manifest.label_axis_values,
        label_mode=functools.partial(label_mode, ds.targets, ds.split("train"), chunk_rows),
    )


def run(cfg: RunConfig, ctx: StageContext, *, staged: Path, trained: Path) -> CollapseSummary:
    """The collapse-check stage; raises CollapseError (after writing the report) when all
    candidates collapse."""
    ds, model, ckpt, rows = check_rows(
        staged,
        trained,
        ctx.stage,
        cfg.collapse.max_rows,
        ModelCode.of(cfg.model, ctx.layout.root),
        cfg.data.chunk_rows,
    )
    device, dev_reason = resolve_device(cfg.runtime.device)
    model.to(device)
    precision, prec_reason = run_precision(cfg.collapse.precision, ckpt)
    report, cal = check_candidates(model, rows, cfg.collapse, precision, device)
    ident = {"model_sha256": sha256_file(trained / MODEL_FILE), "data_fingerprint": ds.fingerprint}
    report = dataclasses.replace(
        report,
        model_sha256=ident["model_sha256"],
        data_fingerprint=ident["data_fingerprint"],
        precision_reason=prec_reason,
        device=f"{device} ({dev_reason})",
    )
    metrics = flat_metrics(report)
    with atomic_dir(ctx.output()) as tmp:
        write_json(tmp / REPORT_FILE, report.to_json())
        write_json(tmp / "metrics.json", metrics)
        write_reference(tmp, rows.features)
        if cal is None:
            (tmp / FAILED_MARKER).write_text(report.why + "\n")
        else:
            write_calibration(tmp, cal, ident)
    out = ctx.output()
    ctx.events.table("candidates", candidate_rows(report))
    ctx.events.artifact(out / REPORT_FILE)
    ctx.events.param("collapse.chosen", report.chosen or "none")
    ctx.events.metrics(metrics)
    if cal is None:
        ctx.events.event("collapse", why=report.why, diagnosis=report.cause.diagnosis)
        for line in verdict_lines(report):  # the cause and what to try
            ctx.logger.warning("%s: %s", ctx.stage, line)
        raise CollapseError(
            f"{ctx.stage}: every candidate collapsed ({', '.join(report.order)}; the cause and "
            f"what to try above); report: {out / REPORT_FILE}"
        )
    ctx.logger.info("%s chose %s: %s", ctx.stage, report.chosen, report.why)
    return CollapseSummary(
        output=str(out),
        chosen=str(report.chosen),
        report=str(out / REPORT_FILE),
        calibration=str(out / CALIBRATION_FILE),
        why=report.why,
    )
