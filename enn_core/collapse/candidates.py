"""collapse-check's candidates, side by side, and the choice.

- `raw`: the model as trained (under the training run's autocast precision), batched;
- `calibrated`: raw plus a per-output affine (slope bounded to [0, collapse.calibration_slope_max])
  fitted on the validation rows, judged on rows its affine was not fitted on (cross-fitting
  over collapse.calibration_folds folds) by skill as well as spread: median correlation with
  the targets >= collapse.min_correlation and MAE below the best naive predictor's (the
  lowest validation MAE of the means and medians, enn_core.metrics.best_naive).
  Stretching a flat output therefore cannot pass;
- `fp32`: the model re-run in fp32 (only when the run used bf16 or fp16);
- `per_sample`: the model re-run at batch size 1 (exposes batch-level broadcast bugs).

`collapse.order` picks the first candidate that passes; the cause is read from the
differences between candidates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from enn_core.checkpoint import Checkpoint
from enn_core.collapse.measures import (
    broadcast_measures,
    correlation_measures,
    criteria,
    cross_fit,
    fit_affine,
    spread_measures,
)
from enn_core.collapse.report import Candidate, Cause, CollapseReport, mostly_one_value
from enn_core.config import CollapseConfig
from enn_core.data.label_mode import LabelMode
from enn_core.inference import Calibration, PredictionPath, predict_rows
from enn_core.metric_names import PROMOTION_BASELINE
from enn_core.metrics import evaluate_split, with_best_naive
from enn_core.model.enn import ENN

# Batched vs batch-size-1 outputs further apart than this x label std mean the model's output
# for a row depends on the other rows of its batch (fp32 kernels differ by ~1e-6 relative).
BATCH_DEPENDENCE_TOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 5e-3}
THRESHOLDS = (
    "median_ratio_min",
    "p10_ratio_min",
    "flat_tolerance",
    "max_flat_fraction",
    "broadcast_tolerance",
    "max_broadcast_fraction",
    "min_correlation",
    "calibration_slope_max",
)


@dataclass(frozen=True)
class CheckRows:
    """What the check reads, already in memory: the validation rows and their references."""

    features: np.ndarray
    target: np.ndarray
    naive: Mapping[str, np.ndarray]
    label_std: float
    axes: tuple[str, ...] = ()
    axis_values: Mapping[str, list[str]] | None = None
    label_mode: Callable[[], LabelMode] | None = None
    """The training labels' majority value per output (enn_core.data.label_mode), read only
    when every candidate collapsed: a label that is mostly one value is a cause of its own."""


def run_precision(requested: str, ckpt: Checkpoint | None) -> tuple[str, str]:
    """The raw candidate's precision and why: the config, else what the training run recorded."""
    if requested != "auto":
        return requested, f"collapse.precision={requested}"
    rec = (ckpt.meta if ckpt is not None else {}).get("precision")
    if isinstance(rec, Mapping):
        rec = rec.get("precision") or rec.get("choice") or rec.get("dtype")
    if rec in ("fp32", "bf16", "fp16"):
        return str(rec), f"the training run recorded precision={rec}"
    return "fp32", "the checkpoint records no training precision; fp32 assumed"


def judge(pred: np.ndarray, rows: CheckRows, cfg: CollapseConfig, *, skill: bool) -> Candidate:
    metrics, _, _ = evaluate_split(
        "val", pred, rows.target, rows.naive, rows.axes, rows.axis_values
    )
    m = spread_measures(pred, rows.target, cfg.flat_tolerance)
    m.update(broadcast_measures(rows.features, pred, cfg.broadcast_tolerance * rows.label_std))
    m.update(correlation_measures(pred, rows.target))
    m["mae"] = metrics["val/mae"]
    # the skill bar: the best naive predictor for MAE on these rows (medians and means)
    metrics, _ = with_best_naive(metrics, ("val",))
    m["naive_best_mae"] = metrics.get(PROMOTION_BASELINE, math.inf)
    crit = criteria(m, cfg, skill=skill)
    fails = [c for c in crit if not c.ok]
    return Candidate(
        status="failed" if fails else "passed",
        measures=m,
        criteria=tuple(crit),
        reasons=tuple(c.describe() for c in fails),
        # how far from passing: the largest shortfall relative to its threshold
        distance=max((c.gap / max(abs(c.threshold), 1e-12) for c in fails), default=0.0),
        metrics=metrics,
    )


def check_candidates(
    model: ENN,
    rows: CheckRows,
    cfg: CollapseConfig,
    precision: str,
    device: torch.device | str = "cpu",
) -> tuple[CollapseReport, Calibration | None]:
    """Every candidate side by side, the cause, and the choice (`cfg`: the collapse section)."""
    idx = np.arange(len(rows.features))

    def run_path(cal: Calibration) -> np.ndarray:
        path = PredictionPath(model, cal).to(device)
        return predict_rows(path, rows.features, idx, cfg.batch_size, device)

    preds: dict[str, np.ndarray] = {"raw": run_path(Calibration("raw", precision))}
    cands: dict[str, Candidate] = {"raw": judge(preds["raw"], rows, cfg, skill=False)}
    slope, intercept = fit_affine(preds["raw"], rows.target, cfg.calibration_slope_max)
    if len(idx) < 2 * 2:
        cands["calibrated"] = Candidate(
            status="not_applicable",
            reason=f"{len(idx)} validation rows: too few to fit and judge an affine on "
            "held-out rows",
        )
    else:
        preds["calibrated"] = cross_fit(
            preds["raw"], rows.target, cfg.calibration_folds, cfg.calibration_slope_max
        )
        judged = judge(preds["calibrated"], rows, cfg, skill=True)
        slopes = _slope_summary(slope, cfg.calibration_slope_max)
        cands["calibrated"] = Candidate(**{**vars(judged), "slope": slopes})
    if precision == "fp32":
        cands["fp32"] = Candidate(
            status="not_applicable", reason="the raw candidate already runs in fp32"
        )
    else:
        preds["fp32"] = run_path(Calibration("fp32", "fp32"))
        cands["fp32"] = judge(preds["fp32"], rows, cfg, skill=False)
    preds["per_sample"] = run_path(Calibration("per_sample", precision))
    cands["per_sample"] = judge(preds["per_sample"], rows, cfg, skill=False)

    chosen = next((c for c in cfg.order if cands[c].status == "passed"), None)
    report = CollapseReport(
        status="passed" if chosen else "failed",
        chosen=chosen,
        why=_why(chosen, cfg.order, cands),
        order=tuple(cfg.order),
        precision=precision,
        n_rows=int(len(idx)),
        thresholds={k: getattr(cfg, k) for k in THRESHOLDS},
        candidates=cands,
        cause=_cause(preds, cands, rows, precision),
    )
    if chosen is None:
        return report, None
    affine = chosen == "calibrated"
    cal = Calibration(
        chosen,
        "fp32" if chosen == "fp32" else precision,
        slope if affine else None,
        intercept if affine else None,
    )
    return report, cal


def _slope_summary(slope: np.ndarray, slope_max: float) -> dict[str, float]:
    s = slope.reshape(-1)
    return {
        "median": float(np.median(s)),
        "min": float(s.min()),
        "max": float(s.max()),
        "at_bound": float(np.mean((s <= 0) | (s >= slope_max))),
    }


def _cause(
    preds: Mapping[str, np.ndarray],
    cands: Mapping[str, Candidate],
    rows: CheckRows,
    precision: str,
) -> Cause:
    """Which part of the path collapses, from the differences between candidates."""
    scale = max(rows.label_std, 1e-12)
    bd = float(np.max(np.abs(preds["raw"] - preds["per_sample"]))) / scale
    dependent = bool(bd > BATCH_DEPENDENCE_TOL.get(precision, 1e-4))
    effect = None
    if "fp32" in preds:
        effect = float(np.max(np.abs(preds["raw"] - preds["fp32"]))) / scale
    status = {k: v.status for k, v in cands.items()}
    mode = None
    if status["raw"] == "passed":
        text = "no collapse: the raw predictions pass"
    elif dependent and status["per_sample"] == "passed":
        text = (
            "batch-level broadcast: a row's output depends on the other rows of its batch "
            f"(batched vs batch-size-1 outputs differ by {bd:.3g} x label std); the model "
            "mixes or broadcasts along the batch dimension"
        )
    elif status.get("fp32") == "passed":
        text = (
            f"reduced precision: the {precision} run collapses and the fp32 re-run does not "
            "(tail quantization)"
        )
    elif status.get("calibrated") == "passed":
        text = (
            "under-dispersed outputs: the model ranks rows well but compresses their spread; "
            "a per-output affine restores it"
        )
    else:
        mode = rows.label_mode() if rows.label_mode is not None else None
        mode = mode if mode is not None and mode.mostly_one_value else None
        text = (
            mostly_one_value(mode, cands["raw"])
            if mode is not None
            else "the model's predictions themselves collapsed (no candidate restores spread "
            "with skill); retrain or change the model"
        )
    return Cause(
        batch_dependence=bd,
        batch_dependent=dependent,
        diagnosis=text,
        precision_effect=effect,
        label_mode=None if mode is None else mode.top_value,
        label_mode_share=None if mode is None else mode.top_share,
        label_mostly_outputs=None if mode is None else mode.n_mostly,
    )


def _why(chosen: str | None, order: tuple[str, ...], cands: Mapping[str, Candidate]) -> str:
    def reason(c: str) -> str:
        return f"{c}: {cands[c].explain()}"

    earlier = [reason(c) for c in (order[: order.index(chosen)] if chosen else order)]
    if chosen is None:
        return "every candidate collapsed: " + " | ".join(earlier)
    head = f"{chosen} is the first candidate in collapse.order that passes"
    return head + (" (" + " | ".join(earlier) + ")" if earlier else "")
