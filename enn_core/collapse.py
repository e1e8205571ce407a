"""collapse-check stage: find prediction collapse and its cause, and never hide it.

ENN-PyTorch shipped one 39 x 24 map repeated for all 168 groups. This stage measures the
model's predictions on the validation rows and compares candidate prediction paths side by side:

- `raw`: the model as trained (under the training run's autocast precision), batched;
- `calibrated`: raw plus a per-output affine (slope bounded to [0, collapse.calibration_slope_max])
  fitted on the validation rows; it is judged on rows its affine was not fitted on
  (cross-fitting over collapse.calibration_folds folds) by skill as well as spread: median
  correlation with the targets >= collapse.min_correlation and MAE below the conditional naive
  predictor's. Stretching a flat output therefore cannot pass;
- `fp32`: the model re-run in fp32 (only when the run used bf16 or fp16);
- `per_sample`: the model re-run at batch size 1 (exposes batch-level broadcast bugs).

Measures per candidate: the spread ratio of enn_core.baselines (median and 10th percentile),
the fraction of flat outputs, broadcast detection (distinct inputs, near-identical outputs),
correlation with the targets. `collapse.order` picks the first candidate that passes.

Outputs (`outputs/collapse-check/`, replaced atomically as one directory):
- passed: `report.json` (every candidate, how far each was from passing, the cause, the chosen
  candidate's validation metrics), `calibration.json` (+ `slope.npy`/`intercept.npy` for the
  calibrated candidate).
- all collapsed: `report.json` and a `FAILED` marker, no `calibration.json`; then the stage raises
  CollapseError. A previous passing output is replaced, so export (which requires
  calibration.json and refuses on FAILED) can never ship a stale calibration.

Values are never nudged apart to hide ties. `PredictionPath(model, calibration)` is the chosen
candidate's full path (raw features in, real units out): export exports it, predict runs it.
`measure_predictions` is the targets-free check the prediction flow runs on new data.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from enn_core.atomic import atomic_dir, write_json
from enn_core.baselines import collapse_stats
from enn_core.errors import CollapseError, StaleOutputError
from enn_core.validate import evaluate_split, load_staged, naive_predictions, predict_rows, select_device

CANDIDATES: tuple[str, ...] = ("raw", "calibrated", "fp32", "per_sample")
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
FAILED_MARKER = "FAILED"
CALIBRATION_FILE = "calibration.json"
REPORT_FILE = "report.json"
# Batched vs batch-size-1 outputs further apart than this x label std mean the model's output
# for a row depends on the other rows of its batch (fp32 kernels differ by ~1e-6 relative).
BATCH_DEPENDENCE_TOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 5e-3}
BROADCAST_SAMPLE_ROWS = 512


@dataclass(frozen=True)
class Calibration:
    """The chosen prediction path: candidate, autocast precision, optional per-output affine."""

    candidate: str = "raw"
    precision: str = "fp32"
    slope: np.ndarray | None = None
    intercept: np.ndarray | None = None


class PredictionPath(nn.Module):
    """Raw feature vector [B, F] in, calibrated real units [B, *label_shape] out.

    Encoding and normalization live in the model (`model.predict`); this adds the candidate's
    precision, the per-sample loop and the affine. `per_sample` loops rows, so it is correct
    for a batch-dependent model but cannot be exported with a dynamic batch.
    """

    def __init__(self, model: nn.Module, calibration: Calibration | None = None) -> None:
        super().__init__()
        cal = calibration or Calibration()
        if cal.candidate not in CANDIDATES:
            raise StaleOutputError(f"calibration candidate {cal.candidate!r} is not one of {CANDIDATES}; re-run collapse-check")
        self.model = model
        self.candidate = cal.candidate
        self.precision = cal.precision
        self.per_sample = cal.candidate == "per_sample"
        self.has_affine = cal.slope is not None
        if self.has_affine:
            self.register_buffer("slope", torch.as_tensor(np.asarray(cal.slope), dtype=torch.float32))
            self.register_buffer("intercept", torch.as_tensor(np.asarray(cal.intercept), dtype=torch.float32))

    def _batch(self, x: torch.Tensor) -> torch.Tensor:
        if self.precision in AUTOCAST:
            with torch.autocast(x.device.type, dtype=AUTOCAST[self.precision]):
                y = self.model.predict(x)
        else:
            y = self.model.predict(x)
        y = y.float()
        if self.has_affine:
            y = y * self.slope + self.intercept
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.per_sample:
            return torch.cat([self._batch(x[i : i + 1]) for i in range(x.shape[0])], dim=0)
        return self._batch(x)


# ---------------------------------------------------------------- measures


def _flat(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float64).reshape(len(a), -1)


def target_spread(labels: np.ndarray) -> np.ndarray:
    """Per-output standard deviation across rows (the reference spread; e.g. training targets)."""
    return _flat(labels).std(axis=0)


def spread_measures(pred: np.ndarray, reference: np.ndarray, flat_tolerance: float) -> dict:
    """Spread ratio (median, p10) and flat fraction; `reference` = targets [N, ...] on the same
    rows (ratio via enn_core.baselines.collapse_stats) or a per-output std (no targets)."""
    p = _flat(pred)
    pred_std = p.std(axis=0)
    if reference.shape[0] == p.shape[0] and reference.ndim == pred.ndim:
        stats = collapse_stats(pred, reference)
        ref_std = _flat(reference).std(axis=0)
        median, p10 = float(stats["median_ratio"]), float(stats["p10_ratio"])
    else:
        ref_std = np.asarray(reference, dtype=np.float64).reshape(-1)
        ratio = pred_std[ref_std > 0] / ref_std[ref_std > 0]
        median, p10 = (float(np.median(ratio)), float(np.percentile(ratio, 10))) if ratio.size else (0.0, 0.0)
    ok = ref_std > 0
    flat = pred_std[ok] < flat_tolerance * ref_std[ok]
    return {
        "spread_median": median,
        "spread_p10": p10,
        "flat_fraction": float(flat.mean()) if flat.size else 1.0,
        "n_outputs": int(p.shape[1]),
    }


def broadcast_measures(features: np.ndarray, pred: np.ndarray, tol_abs: float, seed: int = 0) -> dict:
    """Rows with distinct inputs whose outputs are identical within `tol_abs` (max |diff|)."""
    x = np.asarray(features, dtype=np.float64).reshape(len(features), -1)
    p = _flat(pred)
    if len(p) > BROADCAST_SAMPLE_ROWS:  # pairwise cost: a seeded sample is enough to see it
        keep = np.sort(np.random.default_rng(seed).choice(len(p), BROADCAST_SAMPLE_ROWS, replace=False))
        x, p = x[keep], p[keep]
    _, input_id = np.unique(x, axis=0, return_inverse=True)
    input_id = input_id.reshape(-1)
    n_distinct = int(input_id.max()) + 1 if len(input_id) else 0
    if n_distinct < 2:
        return {"broadcast_fraction": 0.0, "distinct_inputs": n_distinct, "rows_checked": len(p)}
    t = torch.as_tensor(p)
    dist = torch.cdist(t, t, p=float("inf")).numpy()
    same_input = input_id[:, None] == input_id[None, :]
    dist[same_input] = np.inf
    shared = dist.min(axis=1) <= tol_abs
    return {
        "broadcast_fraction": float(shared.mean()),
        "distinct_inputs": n_distinct,
        "rows_checked": int(len(p)),
        "min_output_distance": float(dist.min()),
    }


def correlation_measures(pred: np.ndarray, target: np.ndarray) -> dict:
    """Per-output Pearson correlation across rows with the targets: median and p10."""
    p, y = _flat(pred), _flat(target)
    pc, yc = p - p.mean(axis=0), y - y.mean(axis=0)
    den = np.sqrt((pc**2).sum(axis=0) * (yc**2).sum(axis=0))
    ok = den > 0
    corr = (pc * yc).sum(axis=0)[ok] / den[ok]
    if corr.size == 0:  # a flat prediction has no correlation at all
        return {"correlation_median": 0.0, "correlation_p10": 0.0}
    return {"correlation_median": float(np.median(corr)), "correlation_p10": float(np.percentile(corr, 10))}


def criteria(measures: Mapping, cfg, *, skill: bool) -> list[dict]:
    """Each pass criterion with its value, threshold and whether it holds."""
    rows = [
        ("spread_median", ">=", cfg.median_ratio_min),
        ("spread_p10", ">=", cfg.p10_ratio_min),
        ("flat_fraction", "<=", cfg.max_flat_fraction),
        ("broadcast_fraction", "<=", cfg.max_broadcast_fraction),
    ]
    if skill:
        rows.append(("correlation_median", ">=", cfg.min_correlation))
        rows.append(("mae", "<", measures.get("naive_conditional_mae", math.inf)))
    out = []
    for name, op, thr in rows:
        v = float(measures.get(name, math.nan))
        ok = v >= thr if op == ">=" else (v <= thr if op == "<=" else v < thr)
        gap = 0.0 if ok else abs(thr - v) if math.isfinite(v) else math.inf
        out.append({"measure": name, "value": v, "op": op, "threshold": float(thr), "ok": bool(ok), "gap": gap})
    return out


def measure_predictions(
    pred: np.ndarray,
    reference: np.ndarray,
    cfg,
    *,
    features: np.ndarray | None = None,
    label_std: float | None = None,
) -> dict:
    """The collapse verdict for predictions, with or without targets.

    `reference`: targets on the same rows, or (new data, no targets) the per-output spread of the
    training targets (`target_spread(train_labels)`). `cfg`: the collapse config section.
    Returns the measures, each criterion, and `collapsed` with the reasons.
    """
    m = spread_measures(pred, reference, cfg.flat_tolerance)
    if features is not None:
        scale = label_std if label_std else float(np.mean(target_spread(reference))) if reference.ndim == pred.ndim else 1.0
        m.update(broadcast_measures(features, pred, cfg.broadcast_tolerance * max(scale, 1e-12)))
    if reference.shape == pred.shape:
        m.update(correlation_measures(pred, reference))
    crit = criteria(m, cfg, skill=False)
    fails = [c for c in crit if not c["ok"] and not math.isnan(c["value"])]
    return {"measures": m, "criteria": crit, "collapsed": bool(fails), "reasons": [describe(c) for c in fails]}


def describe(c: Mapping) -> str:
    return f"{c['measure']} {c['value']:.4g} (needs {c['op']} {c['threshold']:.4g})"
