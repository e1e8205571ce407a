"""Seeded splits, group folds, and the synthetic generator's learnability."""

from __future__ import annotations

import numpy as np

from enn_core.data.dataset import StagedDataset
from enn_core.stages.demo import small_config, stage_synthetic


def _splits(ds: StagedDataset) -> dict[str, np.ndarray]:
    return {n: np.asarray(ds.split(n)) for n in ("train", "val", "test")}


def test_random_splits_seeded_exact_and_independent_of_chunk_size(tmp_path):
    a = StagedDataset(stage_synthetic(tmp_path / "a", data_overrides={"chunk_rows": 5}))
    b = StagedDataset(stage_synthetic(tmp_path / "b", data_overrides={"chunk_rows": 1000}))
    c = StagedDataset(stage_synthetic(tmp_path / "c", data_overrides={"split_seed": 1}))
    sa, sb, sc = _splits(a), _splits(b), _splits(c)
    n = a.n_rows
    assert len(sa["test"]) == round(0.15 * n) and len(sa["val"]) == round(
        0.15 * (n - len(sa["test"]))
    )
    assert np.array_equal(np.sort(np.concatenate(list(sa.values()))), np.arange(n))  # a partition
    for k in sa:
        assert np.array_equal(sa[k], sb[k])
    assert not np.array_equal(sa["test"], sc["test"])
    assert a.fingerprint == b.fingerprint != c.fingerprint
    np.testing.assert_array_equal(a.labels, b.labels)


def test_group_folds_hold_out_whole_months(tmp_path):
    folds = (("01", "02", "03"), ("04", "05", "06"), ("07", "08", "09"), ("10", "11", "12"))
    data = small_config({"fold_key": "month", "folds": folds, "test_fold": 2, "val_fold": 0})
    ds = StagedDataset(stage_synthetic(tmp_path, data=data))
    month = ds.row_keys["month"].to_numpy()
    s = _splits(ds)
    assert set(month[s["test"]]) == {"07", "08", "09"} and set(month[s["val"]]) == {
        "01",
        "02",
        "03",
    }
    assert not set(month[s["train"]]) & {"01", "02", "03", "07", "08", "09"}
    d = ds.manifest.split_definition
    assert d["fold_key"] == "month" and d["test_fold"] == 2 and d["folds"][2] == ["07", "08", "09"]
    # a held-out month still has its code and cyclic phase (vocabulary = the whole period)
    spec = ds.feature_specs[0]
    assert spec["vocab"][6] == "07" and set(ds.features[s["test"], 0]) == {6.0, 7.0, 8.0}


def test_fold_with_random_validation(tmp_path):
    data = small_config({"fold_key": "month", "folds": (("12",),), "val_fraction": 0.25})
    ds = StagedDataset(stage_synthetic(tmp_path, data=data))
    s = _splits(ds)
    month = ds.row_keys["month"].to_numpy()
    assert set(month[s["test"]]) == {"12"}
    assert len(s["val"]) == round(0.25 * (ds.n_rows - len(s["test"])))


def test_validation_by_key_holds_out_whole_training_months(tmp_path):
    """data.val_by_key: validation is whole months of the training folds (seeded), so early
    stopping measures a month no training row had, as the test fold does."""
    folds = (("01", "02", "03"), ("04", "05", "06"), ("07", "08", "09"), ("10", "11", "12"))
    fields = {"fold_key": "month", "folds": folds, "test_fold": 0, "val_by_key": True}
    data = small_config({**fields, "val_fraction": 0.2})
    ds = StagedDataset(stage_synthetic(tmp_path / "a", data=data))
    month = ds.row_keys["month"].to_numpy()
    s = _splits(ds)
    val, train = set(month[s["val"]]), set(month[s["train"]])
    assert set(month[s["test"]]) == {"01", "02", "03"}
    assert len(val) == 2 and not val & train and not val & {"01", "02", "03"}  # 20% of 9
    assert val | train == {f"{m:02d}" for m in range(4, 13)}
    assert ds.manifest.split_definition["val_by_key"] is True
    again = StagedDataset(stage_synthetic(tmp_path / "b", data=data))
    assert set(again.row_keys["month"].to_numpy()[again.split("val")]) == val  # seeded
    rows = StagedDataset(stage_synthetic(tmp_path / "c", data=small_config(fields)))
    assert rows.fingerprint != ds.fingerprint


def _design(ds: StagedDataset, rows: np.ndarray) -> np.ndarray:
    """One-hot (month) + one-hot (daytype x direction): what a model of the keys can learn."""
    x = np.asarray(ds.features[rows]).astype(int)
    n_m, n_d, n_r = (len(s["vocab"]) for s in ds.feature_specs)
    month = np.eye(n_m)[x[:, 0]]
    cell = np.eye(n_d * n_r)[x[:, 1] * n_r + x[:, 2]]
    return np.concatenate([month, cell], axis=1)


def test_synthetic_is_seeded_and_a_key_model_beats_the_per_cell_mean(tmp_path):
    ds = StagedDataset(stage_synthetic(tmp_path / "a", n_replicates=3, n_sections=5, n_hours=12))
    again = StagedDataset(stage_synthetic(tmp_path / "b", n_replicates=3, n_sections=5, n_hours=12))
    np.testing.assert_array_equal(ds.labels, again.labels)
    train, test = ds.split("train"), ds.split("test")
    y = np.asarray(ds.labels).reshape(ds.n_rows, -1).astype(np.float64)
    cell_mean = y[train].mean(axis=0)
    mse_cell = ((y[test] - cell_mean) ** 2).mean()
    coef, *_ = np.linalg.lstsq(_design(ds, train), y[train], rcond=None)
    mse_model = ((y[test] - _design(ds, test) @ coef) ** 2).mean()
    noise = 2.0**2 + 1.5**2
    assert mse_model < 2 * noise and mse_model < 0.2 * mse_cell, (mse_model, mse_cell)


def test_default_demo_size_has_enough_rows():
    from enn_core.config import DataConfig

    cfg = DataConfig()
    s = cfg.synthetic
    assert cfg.source == "synthetic"
    assert s.n_months * s.n_daytypes * s.n_directions * s.n_replicates >= 500


def test_a_fold_column_splits_the_rows_and_is_not_a_model_input(tmp_path):
    """A CSV's fold column (`data.fold_key`) holds out whole groups; the model does not read
    it, so new inputs staged against the manifest need not carry it."""
    import csv

    from tests.fixtures.data import run_stage

    rng = np.random.default_rng(0)
    rows = [
        [f"r{i % 3}", str(1 + i % 4), f"{x:.3f}", f"{2 * x + 1:.3f}"]
        for i, x in enumerate(rng.normal(size=40))
    ]
    path = tmp_path / "t.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([["region", "quarter", "x", "y"], *rows])
    common = {"source": "csv", "categorical": ("region",), "naive_keys": ("region",)}
    folds = (("1",), ("2",), ("3",), ("4",))
    _, out = run_stage(
        tmp_path / "p",
        **common,
        path=str(path),
        label_columns=("y",),
        label_shape=(1,),
        fold_key="quarter",
        folds=folds,
        test_fold=3,
        val_fold=0,
    )
    ds = StagedDataset(out)
    assert ds.manifest.feature_names == ("region", "x")
    quarter = ds.row_keys["quarter"].astype(str).to_numpy()
    s = _splits(ds)
    assert set(quarter[s["test"]]) == {"4"} and set(quarter[s["val"]]) == {"1"}
    # new inputs without the fold column stage against the training manifest
    new = tmp_path / "new.csv"
    with open(new, "w", newline="") as f:
        csv.writer(f).writerows([["region", "x"], ["r0", "0.5"], ["r2", "-1.0"]])
    _, staged = run_stage(
        tmp_path / "q",
        **common,
        path=str(new),
        features_only=True,
        training_manifest=str(out / "manifest.json"),
        fold_key="quarter",
        label_shape=(1,),
    )
    assert StagedDataset(staged).manifest.feature_names == ("region", "x")


def test_validation_by_key_needs_folds_and_no_val_fold():
    import pytest

    from enn_core.config import DataConfig
    from enn_core.errors import ConfigError

    with pytest.raises(ConfigError, match="data.val_by_key needs data.folds and data.val_fold -1"):
        DataConfig(val_by_key=True)
