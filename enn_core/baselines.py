"""Baselines and the collapse measure, defined once (validate, collapse-check and the quality
report all use these).

- `cell_mean` / `cell_median`: the plain per-cell mean or median of the training labels.
- `ConditionalNaive`: the mean (or, with `statistic="median"`, the median) of the same cell
  over the training rows that share the declared key columns (e.g. day type and direction),
  falling back to the per-cell statistic for a key combination the training rows never had.
  For MAE the median is the best constant, for squared error the mean: validate scores both
  (enn_core.metrics).
- `spread_ratio` / `collapse_stats`: per output, the std across samples of the prediction
  over the std of the target; collapse = median ratio < 0.5 or 10th percentile < 0.3.

Key columns come from the staged `row_keys.parquet` (a DataFrame), a mapping name -> array,
or a 2-D array whose columns follow `key_names`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from enn_core.errors import DataError

if TYPE_CHECKING:
    import pandas as pd

    # Key columns: the staged row_keys DataFrame, a mapping name -> column, or a 2-D array.
    KeyColumns: TypeAlias = pd.DataFrame | Mapping[str, Sequence[object] | np.ndarray] | np.ndarray

MEDIAN_RATIO_MIN = 0.5
P10_RATIO_MIN = 0.3


def _key_rows(keys: KeyColumns, key_names: Sequence[str], n: int) -> list[tuple[Any, ...]]:
    """Rows of key values as tuples, from a DataFrame, a mapping of columns or a 2-D array."""
    if isinstance(keys, np.ndarray):
        arr = keys.reshape(len(keys), -1)
        if arr.shape[1] != len(key_names):
            raise DataError(f"key array has {arr.shape[1]} columns but key_names={list(key_names)}")
        cols = [arr[:, j] for j in range(arr.shape[1])]
    else:
        available = list(keys.keys()) if isinstance(keys, Mapping) else list(keys.columns)
        missing = [k for k in key_names if k not in available]
        if missing:
            raise DataError(
                f"row keys lack columns {missing} (have {available}); "
                "fix data.naive_keys or re-run stage-data"
            )
        cols = [np.asarray(keys[k]) for k in key_names]
    if any(len(c) != n for c in cols):
        raise DataError(
            f"row keys have {len(cols[0]) if cols else 0} rows but labels/predictions have {n}"
        )
    return list(zip(*(c.tolist() for c in cols), strict=True)) if cols else [()] * n


def cell_mean(labels: np.ndarray) -> np.ndarray:
    """Per-cell mean over rows: [N, *shape] -> [*shape] (float64)."""
    labels = np.asarray(labels)
    if len(labels) == 0:
        raise DataError("cell_mean needs at least one training row")
    return labels.astype(np.float64).mean(axis=0)


def cell_median(labels: np.ndarray) -> np.ndarray:
    """Per-cell median over rows: [N, *shape] -> [*shape] (float64)."""
    labels = np.asarray(labels)
    if len(labels) == 0:
        raise DataError("cell_median needs at least one training row")
    return np.median(labels.astype(np.float64), axis=0)


STATISTICS = {"mean": cell_mean, "median": cell_median}


def per_cell_mean_predict(train_labels: np.ndarray, n: int) -> np.ndarray:
    """The per-cell mean repeated for `n` rows: [n, *shape]."""
    m = cell_mean(train_labels)
    return np.broadcast_to(m, (n, *m.shape)).copy()


def per_cell_median_predict(train_labels: np.ndarray, n: int) -> np.ndarray:
    """The per-cell median repeated for `n` rows: [n, *shape] (the best constant for MAE)."""
    m = cell_median(train_labels)
    return np.broadcast_to(m, (n, *m.shape)).copy()


class ConditionalNaive:
    """Mean (or median) of the same cell over training rows sharing `key_names`; the per-cell
    mean (or median) otherwise."""

    def __init__(self, key_names: Sequence[str], statistic: str = "mean") -> None:
        if statistic not in STATISTICS:
            raise ValueError(f"statistic={statistic!r}; use one of {sorted(STATISTICS)}")
        self.key_names = tuple(key_names)
        self.statistic = statistic
        self.group_means: dict[tuple[Any, ...], np.ndarray] = {}  # the statistic per group
        self.fallback: np.ndarray | None = None

    def fit(self, labels: np.ndarray, keys: KeyColumns) -> ConditionalNaive:
        labels = np.asarray(labels, dtype=np.float64)
        rows = _key_rows(keys, self.key_names, len(labels))
        stat = STATISTICS[self.statistic]
        self.fallback = stat(labels)
        groups: dict[tuple[Any, ...], int] = {}
        idx = np.fromiter(
            (groups.setdefault(r, len(groups)) for r in rows), dtype=np.int64, count=len(rows)
        )
        self.group_means = {k: stat(labels[idx == i]) for k, i in groups.items()}
        return self

    def predict(self, keys: KeyColumns, n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(predictions [n, *shape], fell_back [n] bool: key combination unseen in training)."""
        if self.fallback is None:
            raise RuntimeError("ConditionalNaive.predict before fit")
        if n is None:
            n = len(keys) if not isinstance(keys, Mapping) else len(next(iter(keys.values())))
        rows = _key_rows(keys, self.key_names, n)
        out = np.empty((n, *self.fallback.shape))
        fell_back = np.zeros(n, dtype=bool)
        for i, r in enumerate(rows):
            m = self.group_means.get(r)
            fell_back[i] = m is None
            out[i] = self.fallback if m is None else m
        return out, fell_back


def conditional_naive_predict(
    train_labels: np.ndarray,
    train_keys: KeyColumns,
    eval_keys: KeyColumns,
    key_names: Sequence[str],
    n_eval: int | None = None,
    statistic: str = "mean",
) -> np.ndarray:
    """One call: fit on the training rows, predict the evaluation rows."""
    naive = ConditionalNaive(key_names, statistic).fit(train_labels, train_keys)
    return naive.predict(eval_keys, n_eval)[0]


def regression_errors(pred: np.ndarray, target: np.ndarray) -> dict[str, float]:
    """MAE and RMSE over all cells (real units in, real units out)."""
    diff = np.asarray(pred, dtype=np.float64) - np.asarray(target, dtype=np.float64)
    return {"mae": float(np.abs(diff).mean()), "rmse": float(np.sqrt((diff**2).mean()))}


def spread_ratio(pred: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per output: std across samples of pred / std of target (NaN where the target is flat)."""
    pred = np.asarray(pred, dtype=np.float64)
    target = np.asarray(target, dtype=np.float64)
    if pred.shape != target.shape or pred.ndim < 1 or len(pred) < 2:
        raise DataError(
            "spread_ratio needs pred and target of the same shape with >= 2 rows; "
            f"got {pred.shape} and {target.shape}"
        )
    ps = pred.reshape(len(pred), -1).std(axis=0)
    ts = target.reshape(len(target), -1).std(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ts > 0, ps / np.where(ts > 0, ts, 1.0), np.nan)


def collapse_stats(
    pred: np.ndarray,
    target: np.ndarray,
    median_min: float = MEDIAN_RATIO_MIN,
    p10_min: float = P10_RATIO_MIN,
) -> dict[str, Any]:
    """{median_ratio, p10_ratio, collapsed, n_outputs, n_flat_targets}:
    collapse = median < median_min or p10 < p10_min."""
    ratio = spread_ratio(pred, target)
    valid = ratio[np.isfinite(ratio)]
    if valid.size == 0:
        raise DataError(
            "collapse_stats: every target output is constant across samples; "
            "the spread ratio is undefined"
        )
    median, p10 = float(np.median(valid)), float(np.percentile(valid, 10))
    return {
        "median_ratio": median,
        "p10_ratio": p10,
        "collapsed": bool(median < median_min or p10 < p10_min),
        "median_min": median_min,
        "p10_min": p10_min,
        "n_outputs": int(ratio.size),
        "n_flat_targets": int(ratio.size - valid.size),
    }
