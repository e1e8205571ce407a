"""validate's numbers: MAE / RMSE / R² in real units, per-axis breakdowns, naive flags."""

from __future__ import annotations

import math

import numpy as np
import pytest

from enn_core.metrics import (
    SplitScore,
    axis_breakdown,
    best_naive,
    evaluate_split,
    finite_or_none,
    naive_predictions,
    one_warning,
    regression_metrics,
    with_best_naive,
)

pytestmark = pytest.mark.timeout(30)


def _grid() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    target = (80 + 10 * rng.standard_normal((10, 2, 3))).astype(np.float32)
    return target, target.copy()


def test_metrics_match_hand_computation():
    target, pred = _grid()
    pred[:, 0, :] += 2.0  # section 0 off by +2, section 1 exact
    m = regression_metrics(pred, target)
    assert m["mae"] == pytest.approx(1.0) and m["rmse"] == pytest.approx(math.sqrt(2.0))
    sst = float(((target - target.mean(axis=0)) ** 2).sum())
    assert m["r2"] == pytest.approx(1 - 4.0 * 30 / sst) and m["n_rows"] == 10
    b = axis_breakdown(pred, target, ("section", "hour"), {"section": ["A-B", "B-C"]})
    assert b["section"]["A-B"]["mae"] == pytest.approx(2.0) and b["section"]["B-C"]["mae"] == 0.0
    assert set(b["hour"]) == {"0", "1", "2"} and b["hour"]["1"]["rmse"] == pytest.approx(
        math.sqrt(2.0)
    )
    assert axis_breakdown(pred.reshape(10, -1), target.reshape(10, -1), ("section", "hour")) == {}


def test_each_naive_predictor_is_flagged_when_not_beaten():
    target, pred = _grid()
    pred += 3.0  # the model is off by 3 everywhere
    naive = {"naive_conditional": target + 1.0, "naive_cell_mean": target + 5.0}
    metrics, breakdown, flags = evaluate_split("test", pred, target, naive, ("section", "hour"))
    assert metrics["test/mae"] == pytest.approx(3.0)
    assert (
        metrics["test/naive_conditional_mae"] == pytest.approx(1.0)
        and metrics["test/worse_than_naive_conditional"] == 1.0
    )
    assert (
        metrics["test/naive_cell_mean_mae"] == pytest.approx(5.0)
        and metrics["test/worse_than_naive_cell_mean"] == 0.0
    )
    assert len(flags) == 1 and "naive_conditional" in flags[0] and "does not beat" in flags[0]
    assert breakdown["naive_cell_mean"]["hour"]["0"]["mae"] == pytest.approx(5.0)
    # a tie is not a win
    _, _, tie_flags = evaluate_split("val", pred, target, {"naive_cell_mean": target - 3.0})
    assert len(tie_flags) == 1
    # the person reads one line for both splits: who beat the model, where (the numbers are
    # on the MAE lines beside it); one split's flag stays whole in the events
    val, _, _ = evaluate_split("val", pred, target, {"naive_cell_mean": target - 3.0})
    both = {**val, **metrics}
    line = one_warning(both, ("val", "test"))
    assert line == (
        "the model's MAE is no better than naive_cell_mean on val; naive_conditional on test"
    )
    same = {**both, "val/worse_than_naive_conditional": 1.0, "test/worse_than_naive_cell_mean": 1.0}
    assert one_warning(same, ("val", "test")) == (
        "the model's MAE is no better than naive_cell_mean and naive_conditional on val and test"
    )
    # naive_best is one of the others again: never named twice; nothing beaten, no line
    assert "naive_best" not in one_warning({**both, "val/worse_than_naive_best": 1.0}, ("val",))
    beat_all = {k: 0.0 if "worse_than" in k else v for k, v in both.items()}
    assert one_warning(beat_all, ("val", "test")) is None


def test_the_best_naive_predictor_is_chosen_on_validation_rows_and_named():
    target, pred = _grid()
    pred += 2.0
    metrics: dict[str, float] = {}
    # on validation rows the median is better; on the test rows the mean happens to be
    for split, cond, med in (("val", 3.0, 1.5), ("test", 1.0, 2.5)):
        naive = {
            "naive_conditional": target + cond,
            "naive_conditional_median": target + med,
            "naive_cell_mean": target + 6.0,
            "naive_cell_median": target + 5.0,
        }
        metrics.update(evaluate_split(split, pred, target, naive)[0])
    out, name = with_best_naive(metrics, ("val", "test"))
    assert name == "naive_conditional_median"  # chosen on val, never on test
    assert out["val/naive_best_mae"] == pytest.approx(1.5)
    assert out["test/naive_best_mae"] == pytest.approx(2.5)  # the same predictor on test
    assert out["test/skill_vs_naive_best"] == pytest.approx(1 - 2.0 / 2.5)
    assert out["val/worse_than_naive_best"] == 1.0 and out["test/worse_than_naive_best"] == 0.0
    # a tie keeps the mean; metrics from before the medians: the conditional mean
    tie = {"val/naive_conditional_mae": 1.0, "val/naive_conditional_median_mae": 1.0}
    assert best_naive(tie) == "naive_conditional"
    assert best_naive({"val/naive_conditional_mae": 1.0}) == "naive_conditional"
    assert with_best_naive({"val/mae": 1.0}, ("val",)) == ({"val/mae": 1.0}, None)


def test_non_finite_metrics_are_written_as_null():
    target = np.ones((1, 2, 2), dtype=np.float32)  # one row: R² undefined
    m = regression_metrics(target, target)
    assert (
        math.isnan(m["r2"]) and finite_or_none(m)["r2"] is None and finite_or_none(m)["mae"] == 0.0
    )


def test_a_split_scored_in_chunks_is_the_split_scored_at_once():
    """validate scores every predictor a chunk of rows at a time (SplitScore): the metrics,
    the breakdown and the flags are those of the whole split at once, to rounding."""
    rng = np.random.default_rng(1)
    target = (50 + 10 * rng.standard_normal((101, 3, 4))).astype(np.float32)
    pred = target + rng.normal(0, 2, target.shape).astype(np.float32)
    naive = {"naive_cell_mean": np.broadcast_to(target.mean(axis=0), target.shape).copy()}
    fitted = {"ridge": pred + 1.0}
    whole = evaluate_split("val", pred, target, naive, ("a", "b"), None, fitted)
    score = SplitScore((3, 4))
    for a in range(0, 101, 17):
        part = slice(a, a + 17)
        preds = {"model": pred[part], "naive_cell_mean": naive["naive_cell_mean"][part]}
        score.add(target[part], {**preds, "ridge": fitted["ridge"][part]})
    chunked = score.result("val", ("a", "b"))
    assert chunked[0].keys() == whole[0].keys() and chunked[2] == whole[2]
    for k, v in whole[0].items():
        assert chunked[0][k] == pytest.approx(v, rel=1e-12), k
    assert chunked[1]["ridge"]["b"]["2"]["mae"] == pytest.approx(whole[1]["ridge"]["b"]["2"]["mae"])


def test_the_naive_predictors_hold_a_statistic_per_column_not_the_rows(tmp_path, monkeypatch):
    """The naive predictors (validate's, collapse-check's) of 200,000 staged rows x 24 labels
    (19 MB as float32, twice that as float64), per key and cell and per cell, means and exact
    medians: read in chunks, they hold a statistic per column and a group number per row;
    whole-table copies and a Python tuple per row held 100 MB here. The medians equal
    np.median's."""
    import tracemalloc

    import pyarrow as pa
    import pyarrow.parquet as pq

    from enn_core import baselines
    from enn_core.data.dataset import StagedDataset
    from tests.fixtures.data import run_stage

    n, rng = 200_000, np.random.default_rng(0)
    store = rng.integers(0, 50, n)
    labels = {f"h{h:02d}": (store + rng.normal(0, 5, n)).astype(np.float32) for h in range(24)}
    table = pa.table({"store": pa.array([f"s{k}" for k in range(50)]).take(store), **labels})
    pq.write_table(table, tmp_path / "t.parquet")
    _, staged = run_stage(
        tmp_path,
        source="parquet",
        path=str(tmp_path / "t.parquet"),
        feature_columns=("store",),
        categorical=("store",),
        cyclic=(),
        cyclic_periods=(),
        cyclic_starts=(),
        label_columns=tuple(labels),
        naive_keys=("store",),
    )
    ds = StagedDataset(staged)
    rows = np.sort(np.asarray(ds.split("val")))[:2048]  # collapse-check's sample
    import pyarrow.compute  # noqa: F401 - imported before the count: modules are not rows
    import scipy.sparse  # noqa: F401

    monkeypatch.setattr(baselines, "STAT_BYTES", 2**20, raising=False)  # a median's block: 1 MB
    monkeypatch.setattr(baselines, "READ_CELLS", 24 * 4096, raising=False)
    tracemalloc.start()
    try:
        got = naive_predictions(ds, rows)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 * 2**20, peak
    train = np.asarray(ds.split("train"))
    y = np.asarray(ds.targets[train], np.float64)
    np.testing.assert_array_equal(got["naive_cell_median"][0], np.median(y, axis=0))
    np.testing.assert_allclose(got["naive_cell_mean"][0], y.mean(axis=0), rtol=1e-12)
    keys = np.asarray(ds.row_keys["store"])
    first = keys[rows[0]]
    mine = y[keys[train] == first]
    np.testing.assert_array_equal(got["naive_conditional_median"][0], np.median(mine, axis=0))
    np.testing.assert_allclose(got["naive_conditional"][0], mine.mean(axis=0), rtol=1e-12)
