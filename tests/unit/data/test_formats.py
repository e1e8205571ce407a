"""Each input format stages to the same contract: raw features, labels, splits, manifest."""

from __future__ import annotations

import json

import blake3
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from enn_core.config import DataConfig
from enn_core.data.dataset import StagedDataset
from tests.fixtures.data import (
    TABLE_CFG,
    run_stage,
    table_rows,
    write_npy_pair,
    write_table_csv,
)


def test_npy_stages_values_exactly(tmp_path):
    x, y = write_npy_pair(tmp_path, n=50, f=4, label_shape=(3, 2))
    result, out = run_stage(tmp_path, source="npy", path=str(x), labels_path=str(y), chunk_rows=7)
    ds = StagedDataset(out)
    assert ds.features.dtype == np.float32 and ds.labels.shape == (50, 3, 2)
    np.testing.assert_array_equal(ds.features, np.load(x))
    np.testing.assert_array_equal(ds.labels, np.load(y))
    assert not ds.features.flags.writeable
    assert result.n_rows == 50 and sum(ds.manifest.splits.values()) == 50
    assert ds.manifest.feature_names == ("f0", "f1", "f2", "f3")
    ds.verify()


def test_npy_labels_reshaped_and_relative_paths(tmp_path):
    (tmp_path / "in").mkdir()
    write_npy_pair(tmp_path / "in", n=20, f=2, label_shape=(6,))
    _, out = run_stage(
        tmp_path, source="npy", path="in/x.npy", labels_path="in/y.npy", label_shape=(2, 3)
    )
    ds = StagedDataset(out)
    assert ds.labels.shape == (20, 2, 3) and ds.manifest.label_shape == (2, 3)
    np.testing.assert_array_equal(ds.labels.reshape(20, 6), np.load(tmp_path / "in/y.npy"))


def test_npz_members_stream(tmp_path):
    x = np.arange(60, dtype=np.float64).reshape(30, 2) / 7
    y = np.arange(30, dtype=np.float32)
    np.savez_compressed(tmp_path / "d.npz", features=x, labels=y)
    _, out = run_stage(tmp_path, source="npz", path=str(tmp_path / "d.npz"), chunk_rows=8)
    ds = StagedDataset(out)
    np.testing.assert_allclose(ds.features, x.astype(np.float32))
    assert ds.labels.shape == (30, 1)


def test_large_magnitudes_stage_as_float64_with_reason(tmp_path):
    x = np.array([[1.0], [2.0**30 + 1]], dtype=np.float64).repeat(10, axis=0)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.ones(20, np.float32))
    _, out = run_stage(
        tmp_path,
        source="npy",
        path=str(tmp_path / "x.npy"),
        labels_path=str(tmp_path / "y.npy"),
        chunk_rows=3,
    )
    ds = StagedDataset(out)
    assert ds.features.dtype == np.float64 and "2**24" in ds.manifest.dtype_reason
    np.testing.assert_array_equal(ds.features, x)


def _check_table(ds: StagedDataset, rows) -> None:
    specs = {s["name"]: s for s in ds.feature_specs}
    assert specs["region"]["kind"] == "categorical" and specs["region"]["vocab"] == [
        "north",
        "south",
        "east",
    ]
    assert "mean" not in specs["region"]  # categorical features are never z-scored
    month = specs["month"]
    assert month["vocab"] == [f"{m:02d}" for m in range(1, 13)] and month["cyclic_period"] == 12
    np.testing.assert_array_equal(ds.features[:, 1], [int(r[1]) - 1 for r in rows])
    np.testing.assert_array_equal(ds.features[:, 0], [i % 3 for i in range(len(rows))])
    # stats of the staged (float32) values, accumulated in float64
    temp = np.array([r[2] for r in rows], np.float32).astype(np.float64)
    train = ds.split("train")
    assert abs(specs["temp"]["mean"] - temp[train].mean()) < 1e-9
    assert abs(specs["temp"]["std"] - temp[train].std()) < 1e-9
    labels = np.array([r[3:] for r in rows], np.float32).reshape(-1, 2, 2)
    np.testing.assert_array_equal(ds.labels, labels)
    assert ds.manifest.row_keys == ("region", "month")
    assert list(ds.row_keys["region"][:3]) == ["north", "south", "east"]


def test_csv_chunked(tmp_path):
    header, rows = table_rows(40)
    path = write_table_csv(tmp_path / "t.csv", rows, header)
    _, out = run_stage(tmp_path, source="csv", path=str(path), chunk_rows=9, **TABLE_CFG)
    _check_table(StagedDataset(out), rows)


def test_parquet_by_row_group(tmp_path):
    header, rows = table_rows(40)
    df = pd.DataFrame(rows, columns=header)
    pq.write_table(
        pa.Table.from_pandas(df, preserve_index=False), tmp_path / "t.parquet", row_group_size=11
    )
    _, out = run_stage(
        tmp_path, source="parquet", path=str(tmp_path / "t.parquet"), chunk_rows=11, **TABLE_CFG
    )
    _check_table(StagedDataset(out), rows)


def test_cyclic_non_categorical_keeps_raw_value(tmp_path):
    header, rows = table_rows(24)
    path = write_table_csv(tmp_path / "t.csv", rows, header)
    _, out = run_stage(
        tmp_path, source="csv", path=str(path), **{**TABLE_CFG, "categorical": ("region",)}
    )
    ds = StagedDataset(out)
    month = ds.feature_specs[1]
    assert (
        month["kind"] == "cyclic" and month["cyclic_offset"] == 1 and month["cyclic_period"] == 12
    )
    np.testing.assert_array_equal(ds.features[:, 1], [int(r[1]) for r in rows])


def test_nonfinite_drop_policy(tmp_path):
    x, y = write_npy_pair(tmp_path, n=30, f=3, label_shape=(2,))
    xa, ya = np.load(x), np.load(y)
    xa[4, 1] = np.nan
    ya[17, 0] = np.inf
    np.save(x, xa)
    np.save(y, ya)
    _, out = run_stage(
        tmp_path, source="npy", path=str(x), labels_path=str(y), nonfinite="drop", chunk_rows=8
    )
    ds = StagedDataset(out)
    keep = [i for i in range(30) if i not in (4, 17)]
    np.testing.assert_array_equal(ds.features, xa[keep])
    assert ds.manifest.dropped_rows == 2
    assert list(ds.row_keys["source_row"]) == keep


def _b3(data: bytes) -> str:
    """BLAKE3-256, spelled as the manifest names it (computed with the blake3 package alone)."""
    return "blake3:" + blake3.blake3(data).hexdigest()


def test_source_hash_of_arrays_hashed_while_staging(tmp_path):
    x = np.random.default_rng(0).normal(size=(40, 3))  # float64 in, float32 staged: hashes fork
    y = np.arange(40, dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    _, out = run_stage(
        tmp_path,
        source="npy",
        path=str(tmp_path / "x.npy"),
        labels_path=str(tmp_path / "y.npy"),
        chunk_rows=16,
    )
    ds = StagedDataset(out)
    data = {"features": _b3(x.tobytes()), "labels": _b3(y.tobytes())}
    assert ds.manifest.source.hash == _b3(json.dumps(data, sort_keys=True).encode())
    # y passed through unchanged: one hash served both the staged file and the source
    assert ds.manifest.files["labels.npy"].hash == data["labels"]
    assert ds.manifest.files["features.npy"].hash == _b3(x.astype(np.float32).tobytes())
    assert "re-run stage-data" in ds.manifest.to_json()["format_policy"]
    ds.verify()


@pytest.mark.timeout(60)
def test_array_hash_ignores_chunking_and_forks_mid_stream(tmp_path):
    """Multi-MB arrays: the hash is BLAKE3 of the data bytes whatever chunk_rows cuts them
    into, and the source hash forks from the staged one correctly (float64 input)."""
    x = np.random.default_rng(1).normal(size=(110_000, 7))  # 6.2 MB float64, 3.1 MB float32
    y = np.random.default_rng(2).normal(size=(110_000, 3)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    want = {"features": _b3(x.tobytes()), "labels": _b3(y.tobytes())}
    for chunk_rows in (9_999, 65_536):
        _, out = run_stage(
            tmp_path,
            source="npy",
            path=str(tmp_path / "x.npy"),
            labels_path=str(tmp_path / "y.npy"),
            chunk_rows=chunk_rows,
        )
        ds = StagedDataset(out)
        files = ds.manifest.files
        assert files["features.npy"].hash == _b3(x.astype(np.float32).tobytes())
        assert files["labels.npy"].hash == want["labels"]
        assert ds.manifest.source.hash == _b3(json.dumps(want, sort_keys=True).encode())
        ds.verify()


def test_scaler_stats_accumulate_in_float64(tmp_path):
    # a large offset with a small spread: float32 accumulation over many rows drifts visibly
    n = 200_000
    x = (1e4 + np.random.default_rng(0).normal(0, 0.01, size=(n, 1))).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.zeros((n, 1), np.float32))
    _, out = run_stage(
        tmp_path, source="npy", path=str(tmp_path / "x.npy"), labels_path=str(tmp_path / "y.npy")
    )
    ds = StagedDataset(out)
    train = x[np.asarray(ds.split("train"))].astype(np.float64)
    spec = ds.feature_specs[0]
    assert abs(spec["mean"] - train.mean()) < 1e-9 * 1e4
    assert abs(spec["std"] - train.std()) < 1e-6


def test_streaming_and_after_pass_splits_agree(tmp_path):
    """Parquet (row count known: splits and stats while staging) and CSV (after the pass)."""
    header, rows = table_rows(300)
    csv = write_table_csv(tmp_path / "t.csv", rows, header)
    df = pd.DataFrame(rows, columns=header)
    pq.write_table(
        pa.Table.from_pandas(df, preserve_index=False), tmp_path / "t.parquet", row_group_size=37
    )
    _, a = run_stage(tmp_path / "a", source="csv", path=str(csv), chunk_rows=50, **TABLE_CFG)
    _, b = run_stage(
        tmp_path / "b", source="parquet", path=str(tmp_path / "t.parquet"), **TABLE_CFG
    )
    da, db = StagedDataset(a), StagedDataset(b)
    for name in ("train", "val", "test"):
        np.testing.assert_array_equal(da.split(name), db.split(name))
    assert da.fingerprint == db.fingerprint
    sa, sb = da.feature_specs[2], db.feature_specs[2]
    assert abs(sa["mean"] - sb["mean"]) < 1e-12 and abs(sa["std"] - sb["std"]) < 1e-12
    assert da.manifest.label_stats == db.manifest.label_stats


def test_csv_features_only_reuses_training_encodings(tmp_path):
    from enn_core.data.staging import stage_features
    from enn_core.errors import DataError
    from enn_core.paths import Layout

    header, rows = table_rows(40)
    train_csv = write_table_csv(tmp_path / "train.csv", rows, header)
    _, trained = run_stage(tmp_path, source="csv", path=str(train_csv), **TABLE_CFG)
    new_rows = [r[:3] for r in rows[5:9]]  # no label columns; a different mix of values
    new_csv = write_table_csv(tmp_path / "new.csv", new_rows, header[:3])
    data = DataConfig(source="csv", path=str(new_csv), **TABLE_CFG)
    stage_features(data, Layout.for_root(tmp_path), tmp_path / "f", trained / "manifest.json")
    ds, tr = StagedDataset(tmp_path / "f"), StagedDataset(trained)
    assert ds.labels is None and ds.feature_specs == tr.feature_specs  # scaler and vocab reused
    np.testing.assert_array_equal(ds.features, tr.features[5:9])
    write_table_csv(tmp_path / "odd.csv", [["west", "01", 1.0]], header[:3])
    odd = DataConfig(source="csv", path=str(tmp_path / "odd.csv"), **TABLE_CFG)
    with pytest.raises(
        DataError,
        match=r"odd.csv line 2 column 'region': value 'west' is not in the training vocabulary",
    ):
        stage_features(odd, Layout.for_root(tmp_path), tmp_path / "g", trained / "manifest.json")
