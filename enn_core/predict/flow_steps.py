"""The prediction flow's enn_core steps: new data in, checked predictions out.

    stage-data (features-only)  ->  predict  ->  collapse-check (targets-free)

1. stage-data: `enn_core.data.staging.run` with `data.features_only=true` and
   `data.training_manifest=<the training staged manifest>` (stage-data's own function).
2. predict: `predict(cfg, ctx, input_dir=..., model_path=...)` is `enn_core.predict.stage.run`
   with `predict.input_dir` / `predict.model` set; the model path is local (the task layer
   resolves `models:/name@alias` first).
3. collapse-check: `check_predictions(cfg, ctx, predictions_dir=..., input_dir=...,
   training_data_dir=...)` measures the predictions against the *training targets' spread*
   (there are no targets for new data) with `enn_core.collapse.measure_predictions`, and writes
   `ctx.output()` atomically:
   - passed: `report.json` and the released prediction files beside it;
   - collapsed: `report.json`, the prediction files under `held/` and a `HELD` marker; then it
     raises CollapseError naming the report, so the flow fails and nothing is released.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from enn_core.atomic import atomic_dir, write_json
from enn_core.collapse.measures import target_spread
from enn_core.collapse.reference import (
    BESIDE_FILE,
    MIN_ROWS,
    TrainingTargets,
    judge_new,
    target_range,
)
from enn_core.data.dataset import StagedDataset
from enn_core.errors import CollapseError, ConfigError, StaleOutputError
from enn_core.predict import stage
from enn_core.summaries import CheckSummary, PredictSummary

if TYPE_CHECKING:
    from enn_core.config import RunConfig
    from enn_core.stage import StageContext

REPORT = "report.json"
HELD_MARKER = "HELD"
HELD_DIR = "held"
RELEASED_FILES = ("predictions.npy", "predictions.parquet", "predictions.xlsx", "manifest.json")


def with_inputs(cfg: RunConfig, *, input_dir: str | Path, model_path: str | Path) -> RunConfig:
    """`cfg` with predict.input_dir and predict.model set (the config stays frozen)."""
    return dataclasses.replace(
        cfg,
        predict=dataclasses.replace(cfg.predict, input_dir=str(input_dir), model=str(model_path)),
    )


def predict(
    cfg: RunConfig,
    ctx: StageContext,
    *,
    input_dir: str | Path,
    model_path: str | Path,
    calibration_name: str,
) -> PredictSummary:
    """The predict stage over a features-only staged dataset with a given model."""
    return stage.run(
        with_inputs(cfg, input_dir=input_dir, model_path=model_path),
        ctx,
        staged=Path(input_dir),
        model=None,
        calibration=None,
        calibration_name=calibration_name,
    )


def predict_new(
    cfg: RunConfig, ctx: StageContext, *, staged: Path, calibration_name: str
) -> PredictSummary:
    """The prediction flow's predict: the features-only data this pipeline staged (`staged`),
    with `predict.model` (a local path: the task layer resolves registry references)."""
    if not cfg.predict.model:
        raise ConfigError(
            "predict.model is empty; give a consolidated checkpoint path or models:/NAME@ALIAS"
        )
    model = ctx.layout.resolve(cfg.predict.model)
    return predict(cfg, ctx, input_dir=staged, model_path=model, calibration_name=calibration_name)


def check_new(
    cfg: RunConfig, ctx: StageContext, *, staged: Path, predictions: Path, training: Path
) -> CheckSummary:
    """The prediction flow's collapse-check: the new predictions against the spread of the
    training targets staged in `training`."""
    return check_predictions(
        cfg, ctx, predictions_dir=predictions, input_dir=staged, training_data_dir=training
    )


def training_targets(training_data_dir: str | Path, split: str = "train") -> TrainingTargets:
    """The training targets' per-output spread (the reference spread) and range, and the label
    std."""
    ds = StagedDataset(training_data_dir)
    if ds.labels is None:
        raise StaleOutputError(
            f"{training_data_dir}: has no labels; give the training staged dataset, "
            "not a features-only one"
        )
    idx = np.sort(np.asarray(ds.split(split)))  # the memmap is read in chunks of these rows
    spread = target_spread(ds.labels, idx)
    low, high = target_range(ds.labels, rows=idx)
    std = float(ds.manifest.label_stats.std or float(np.mean(spread)))
    return TrainingTargets(spread, low, high, std)


def check_predictions(
    cfg: RunConfig,
    ctx: StageContext,
    *,
    predictions_dir: str | Path,
    input_dir: str | Path,
    training_data_dir: str | Path,
) -> CheckSummary:
    """Collapse verdict for new-data predictions, on the evidence there is
    (enn_core/collapse/reference.py); releases them or holds them back with the report."""
    predictions_dir = Path(predictions_dir)
    pred_file = predictions_dir / "predictions.npy"
    if not pred_file.is_file():
        raise StaleOutputError(f"{pred_file}: not found; run predict first")
    preds = np.load(pred_file, mmap_mode="r")
    features = StagedDataset(input_dir).features
    if features.shape[0] != preds.shape[0]:
        raise StaleOutputError(
            f"{pred_file}: {preds.shape[0]} rows but {input_dir} has {features.shape[0]}; "
            "re-run predict on this input"
        )
    manifest = predictions_dir / "manifest.json"
    meta = json.loads(manifest.read_text()) if manifest.is_file() else {}
    beside_file = predictions_dir / BESIDE_FILE
    beside = dict(np.load(beside_file, allow_pickle=False)) if beside_file.is_file() else None
    verdict = judge_new(
        preds,
        features,
        training_targets(training_data_dir),
        cfg.collapse,
        beside,
        meta.get("reference") or {},
    )
    if int(preds.shape[0]) < MIN_ROWS:
        ctx.logger.info("%s: %s", ctx.stage, verdict.get("evidence", ""))
    report = {
        "reference": "training targets' per-output spread (train split)",
        "training_data": str(training_data_dir),
        "input": str(input_dir),
        "predictions": str(predictions_dir),
        "n_rows": int(preds.shape[0]),
        "released": not verdict["collapsed"],
        **verdict,
    }
    out = ctx.output()
    with atomic_dir(out) as tmp:
        dest = tmp / HELD_DIR if verdict["collapsed"] else tmp
        dest.mkdir(exist_ok=True)
        for name in RELEASED_FILES:
            if (predictions_dir / name).is_file():
                shutil.copy2(predictions_dir / name, dest / name)
        write_json(tmp / REPORT, report)
        if verdict["collapsed"]:
            (tmp / HELD_MARKER).write_text("; ".join(verdict["reasons"]) + "\n")
    ctx.events.metrics(
        {f"collapse/{k}": v for k, v in verdict["measures"].items() if isinstance(v, (int, float))}
    )
    ctx.events.param("collapse.released", report["released"])
    ctx.events.artifact(out / REPORT, ctx.stage)
    if verdict["collapsed"]:
        raise CollapseError(
            f"{out / REPORT}: predictions collapsed ({'; '.join(verdict['reasons'])}); "
            f"held back in {out / HELD_DIR}"
        )
    return CheckSummary(
        output=str(out), released=True, report=str(out / REPORT), measures=verdict["measures"]
    )
