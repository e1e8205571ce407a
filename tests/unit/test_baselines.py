"""Baselines (per-cell mean, conditional naive) and the collapse measure."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from enn_core.baselines import (
    ConditionalNaive,
    cell_mean,
    cell_median,
    collapse_stats,
    conditional_naive_predict,
    per_cell_mean_predict,
    per_cell_median_predict,
    regression_errors,
    spread_ratio,
)
from enn_core.errors import DataError


def _data(n=40, seed=0):
    rng = np.random.default_rng(seed)
    keys = pd.DataFrame(
        {
            "month": rng.integers(1, 13, n),
            "daytype": rng.integers(0, 3, n),
            "direction": rng.integers(0, 2, n),
        }
    )
    base = rng.normal(80, 10, (3, 2, 4, 5))  # per (daytype, direction) grid
    labels = base[keys.daytype, keys.direction] + rng.normal(0, 0.1, (n, 4, 5))
    return keys, labels


def test_conditional_naive_means_and_fallback():
    keys, labels = _data()
    naive = ConditionalNaive(["daytype", "direction"]).fit(labels, keys)
    eval_keys = pd.DataFrame({"daytype": [1, 9], "direction": [0, 1]})
    pred, fell_back = naive.predict(eval_keys)
    mask = (keys.daytype == 1) & (keys.direction == 0)
    np.testing.assert_allclose(pred[0], labels[mask.to_numpy()].mean(axis=0))
    np.testing.assert_allclose(pred[1], cell_mean(labels))
    assert fell_back.tolist() == [False, True]
    # Same from a mapping of columns and from a 2-D code array.
    as_map = {"daytype": np.array([1, 9]), "direction": np.array([0, 1])}
    np.testing.assert_array_equal(
        conditional_naive_predict(labels, keys, as_map, ["daytype", "direction"]), pred
    )
    arr = keys[["daytype", "direction"]].to_numpy()
    np.testing.assert_array_equal(
        ConditionalNaive(["daytype", "direction"])
        .fit(labels, arr)
        .predict(np.array([[1, 0], [9, 1]]))[0],
        pred,
    )


def test_conditional_naive_beats_cell_mean_on_keyed_data():
    keys, labels = _data(seed=1)
    train, test = slice(0, 30), slice(30, 40)
    naive = conditional_naive_predict(
        labels[train], keys.iloc[train], keys.iloc[test], ["daytype", "direction"]
    )
    flat = per_cell_mean_predict(labels[train], 10)
    assert flat.shape == labels[test].shape
    assert (
        regression_errors(naive, labels[test])["mae"] < regression_errors(flat, labels[test])["mae"]
    )


def test_medians_per_key_and_per_cell_resist_a_skewed_label():
    """A count-like label: most rows small, a few huge. The median per key (and per cell) is
    the best constant for MAE; the mean is pulled up by the few."""
    keys, _ = _data(n=60, seed=2)
    rng = np.random.default_rng(3)
    labels = rng.poisson(1.0, (60, 4, 5)).astype(float)
    labels[rng.random(60) < 0.1] += 80.0  # one row in ten is an outlier
    cols = ["daytype", "direction"]
    med = ConditionalNaive(cols, "median").fit(labels, keys)
    mask = ((keys.daytype == 1) & (keys.direction == 0)).to_numpy()
    pred, _ = med.predict(pd.DataFrame({"daytype": [1, 7], "direction": [0, 0]}))
    np.testing.assert_allclose(pred[0], np.median(labels[mask], axis=0))
    np.testing.assert_allclose(pred[1], cell_median(labels))  # unseen key: the cell median
    train, test = slice(0, 40), slice(40, 60)
    mae = {
        stat: regression_errors(
            conditional_naive_predict(
                labels[train], keys.iloc[train], keys.iloc[test], cols, statistic=stat
            ),
            labels[test],
        )["mae"]
        for stat in ("mean", "median")
    }
    assert mae["median"] < mae["mean"]
    cell = per_cell_median_predict(labels[train], 20)
    assert (
        regression_errors(cell, labels[test])["mae"]
        < regression_errors(per_cell_mean_predict(labels[train], 20), labels[test])["mae"]
    )
    with pytest.raises(ValueError, match="statistic='mode'"):
        ConditionalNaive(cols, "mode")


def test_missing_key_column_named():
    keys, labels = _data()
    with pytest.raises(DataError, match="weekday"):
        ConditionalNaive(["weekday"]).fit(labels, keys)


def test_spread_and_collapse():
    _, target = _data()
    ok = collapse_stats(target + 0.01, target)
    assert ok["median_ratio"] == pytest.approx(1.0) and not ok["collapsed"]
    repeated = np.broadcast_to(target[:1], target.shape)  # one map for every sample
    assert collapse_stats(repeated, target)["collapsed"]
    half = target.mean(0) + 0.45 * (target - target.mean(0))
    s = collapse_stats(half, target)
    assert s["median_ratio"] == pytest.approx(0.45) and s["collapsed"]
    assert not collapse_stats(half, target, median_min=0.4, p10_min=0.3)["collapsed"]
    # p10 rule: 20% of outputs squashed while the median is fine.
    squashed = target.copy().reshape(len(target), -1)
    squashed[:, :4] = squashed[:, :4].mean(0)
    s = collapse_stats(squashed, target.reshape(len(target), -1))
    assert s["median_ratio"] == pytest.approx(1.0) and s["p10_ratio"] < 0.3 and s["collapsed"]


def test_flat_targets_excluded():
    target = np.zeros((5, 3))
    target[:, 0] = np.arange(5)
    r = spread_ratio(target, target)
    assert r[0] == 1.0 and np.isnan(r[1:]).all()
    assert collapse_stats(target, target)["n_flat_targets"] == 2
