"""collapse-check's measures: spread against the targets (or the training spread), flat
outputs, broadcast across rows with distinct inputs, correlation with the targets, the pass
criteria, and the per-output affine of the calibrated candidate (fitted, and cross-fitted so
it is judged on rows it was not fitted on).

`measure_predictions` is the targets-free verdict the prediction flow runs on new data.
Values are never nudged apart to hide ties.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NotRequired, TypedDict

import numpy as np
import torch

from enn_core.baselines import collapse_stats
from enn_core.collapse.report import Criterion
from enn_core.config import CollapseConfig
from enn_core.errors import DataError

BROADCAST_SAMPLE_ROWS = 512
MAX_OUT_OF_RANGE = 0.01  # fraction of predicted values that may lie out of the targets' range
STD_CHUNK_CELLS = 2_000_000  # label numbers read at once (float64: 16 MB)


class Verdict(TypedDict):
    """`measure_predictions`' verdict: the measures, each criterion (as JSON), and whether the
    predictions collapsed and why; for new data, on what evidence (`reference.judge_new`)."""

    measures: dict[str, float]
    criteria: list[dict[str, Any]]
    collapsed: bool
    reasons: list[str]
    evidence: NotRequired[str]


def _flat(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float64).reshape(len(a), -1)


def column_std(
    a: np.ndarray, chunk_rows: int | None = None, rows: np.ndarray | None = None
) -> np.ndarray:
    """Per-output std across rows of [N, ...] (e.g. a memmap of millions of predictions), or
    across its rows `rows` (indices, sorted for a memmap), in float64, read in chunks so memory
    stays bounded; shifted by the first row for accuracy."""
    n = len(a) if rows is None else len(rows)
    if n == 0:
        raise DataError("no rows to measure; predict at least one row")
    chunk_rows = chunk_rows or _rows_per_chunk(a)

    def part(start: int, stop: int) -> np.ndarray:
        return np.asarray(a[start:stop] if rows is None else a[rows[start:stop]], np.float64)

    shift = part(0, 1).reshape(1, -1)
    s1 = np.zeros(shift.shape[1])
    s2 = np.zeros(shift.shape[1])
    for start in range(0, n, chunk_rows):
        d = part(start, start + chunk_rows).reshape(-1, shift.shape[1]) - shift
        s1 += d.sum(axis=0)
        s2 += (d**2).sum(axis=0)
    return np.sqrt(np.maximum(s2 / n - (s1 / n) ** 2, 0.0))


def _rows_per_chunk(a: np.ndarray) -> int:
    return max(1, STD_CHUNK_CELLS // max(int(np.prod(a.shape[1:])), 1))


def target_spread(labels: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """Per-output standard deviation across rows, or across the rows `rows` of `labels` (the
    reference spread; e.g. training targets)."""
    return column_std(labels, rows=rows)


def spread_measures(
    pred: np.ndarray, reference: np.ndarray, flat_tolerance: float
) -> dict[str, float]:
    """Spread ratio (median, p10) and flat fraction against `reference`: the targets of the same
    rows (same shape as `pred`; the ratio is enn_core.baselines.collapse_stats), or, without
    targets, a per-output std such as `target_spread(training labels)`."""
    pred_std = column_std(pred)
    if reference.shape == pred.shape:
        stats = collapse_stats(pred, reference)
        ref_std = column_std(reference)
        median, p10 = float(stats["median_ratio"]), float(stats["p10_ratio"])
    else:
        ref_std = np.asarray(reference, dtype=np.float64).reshape(-1)
        if ref_std.size != pred_std.size:
            raise DataError(
                f"reference spread has {ref_std.size} outputs but predictions have "
                f"{pred_std.size}; use the training targets of the same model"
            )
        # the same ratio as baselines.spread_ratio, with the reference spread given directly
        ratio = pred_std[ref_std > 0] / ref_std[ref_std > 0]
        median, p10 = (
            (float(np.median(ratio)), float(np.percentile(ratio, 10))) if ratio.size else (0.0, 0.0)
        )
    ok = ref_std > 0
    flat = pred_std[ok] < flat_tolerance * ref_std[ok]
    return {
        "spread_median": median,
        "spread_p10": p10,
        "flat_fraction": float(flat.mean()) if flat.size else 1.0,
        "n_outputs": int(pred_std.size),
    }


def broadcast_measures(
    features: np.ndarray, pred: np.ndarray, tol_abs: float, seed: int = 0
) -> dict[str, float]:
    """Rows with distinct inputs whose outputs are identical within `tol_abs` (max |diff|)."""
    rows = np.arange(len(pred))
    if len(rows) > BROADCAST_SAMPLE_ROWS:  # pairwise cost: a seeded sample is enough to see it
        rows = np.sort(
            np.random.default_rng(seed).choice(rows, BROADCAST_SAMPLE_ROWS, replace=False)
        )
    x = np.asarray(features[rows], dtype=np.float64).reshape(len(rows), -1)
    p = _flat(pred[rows])
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


def correlation_measures(pred: np.ndarray, target: np.ndarray) -> dict[str, float]:
    """Per-output Pearson correlation across rows with the targets: median and p10."""
    p, y = _flat(pred), _flat(target)
    pc, yc = p - p.mean(axis=0), y - y.mean(axis=0)
    den = np.sqrt((pc**2).sum(axis=0) * (yc**2).sum(axis=0))
    ok = den > 0
    corr = (pc * yc).sum(axis=0)[ok] / den[ok]
    if corr.size == 0:  # a flat prediction has no correlation at all
        return {"correlation_median": 0.0, "correlation_p10": 0.0}
    return {
        "correlation_median": float(np.median(corr)),
        "correlation_p10": float(np.percentile(corr, 10)),
    }


def criteria(measures: Mapping[str, float], cfg: CollapseConfig, *, skill: bool) -> list[Criterion]:
    """Each pass criterion with its value, threshold and whether it holds."""
    rows = [
        ("spread_median", ">=", cfg.median_ratio_min),
        ("spread_p10", ">=", cfg.p10_ratio_min),
        ("flat_fraction", "<=", cfg.max_flat_fraction),
        ("broadcast_fraction", "<=", cfg.max_broadcast_fraction),
    ]
    if skill:
        rows.append(("correlation_median", ">=", cfg.min_correlation))
        bar = measures.get("naive_best_mae", measures.get("naive_conditional_mae", math.inf))
        rows.append(("mae", "<", bar))
    # new data (enn_core/collapse/reference.py): what holds for any number of rows
    rows.append(("non_finite_fraction", "<=", 0.0))
    rows.append(("out_of_range_fraction", "<=", MAX_OUT_OF_RANGE))
    out = []
    for name, op, thr in rows:
        if name not in measures:  # e.g. no broadcast check without the inputs
            continue
        v = float(measures[name])
        ok = v >= thr if op == ">=" else (v <= thr if op == "<=" else v < thr)
        gap = 0.0 if ok else abs(thr - v) if math.isfinite(v) else math.inf
        out.append(Criterion(name, v, op, float(thr), bool(ok), gap))
    return out


def measure_predictions(
    pred: np.ndarray,
    reference: np.ndarray,
    cfg: CollapseConfig,
    *,
    features: np.ndarray | None = None,
    label_std: float | None = None,
) -> Verdict:
    """The collapse verdict for predictions, with or without targets.

    `reference`: targets on the same rows, or (new data, no targets) the per-output spread of the
    training targets (`target_spread(train_labels)`). `cfg`: the collapse config section.
    Returns the measures, each criterion, and `collapsed` with the reasons.
    """
    m = spread_measures(pred, reference, cfg.flat_tolerance)
    if features is not None:
        targets = reference.shape == pred.shape
        scale = label_std or float(np.mean(column_std(reference) if targets else reference))
        m.update(broadcast_measures(features, pred, cfg.broadcast_tolerance * max(scale, 1e-12)))
    if reference.shape == pred.shape:
        m.update(correlation_measures(pred, reference))
    crit = criteria(m, cfg, skill=False)
    fails = [c for c in crit if not c.ok]
    return {
        "measures": m,
        "criteria": [vars(c) for c in crit],
        "collapsed": bool(fails),
        "reasons": [c.describe() for c in fails],
    }


def fit_affine(
    pred: np.ndarray, target: np.ndarray, slope_max: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per-output least-squares y ~ a p + b with a clipped to [0, slope_max] (b refitted).

    An output with no spread keeps slope 1: there is nothing to stretch, only an offset.
    """
    p, y = _flat(pred), _flat(target)
    pm, ym = p.mean(axis=0), y.mean(axis=0)
    var = ((p - pm) ** 2).mean(axis=0)
    cov = ((p - pm) * (y - ym)).mean(axis=0)
    slope = np.where(var > 0, cov / np.where(var > 0, var, 1.0), 1.0)
    slope = np.clip(slope, 0.0, slope_max)
    intercept = ym - slope * pm
    shape = pred.shape[1:]
    return slope.reshape(shape).astype(np.float32), intercept.reshape(shape).astype(np.float32)


def cross_fit(
    pred: np.ndarray, target: np.ndarray, folds: int, slope_max: float, seed: int = 0
) -> np.ndarray:
    """Calibrated predictions of every row from an affine fitted on the other folds' rows."""
    n = len(pred)
    parts = np.array_split(np.random.default_rng(seed).permutation(n), min(folds, n))
    out = np.empty(pred.shape, dtype=np.float32)
    for part in parts:
        fit_rows = np.setdiff1d(np.arange(n), part)
        a, b = fit_affine(pred[fit_rows], target[fit_rows], slope_max)
        out[part] = pred[part] * a + b
    return out
