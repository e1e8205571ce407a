"""What export, collapse-check and the prediction flow's check read of every training row's
labels: chunks, not the rows at once (issue 51: at 10^7 rows a float64 copy of the training
labels is 1.5 GB). The values are the ones the whole arrays give."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from enn_core import inference
from enn_core.collapse import measures, reference
from enn_core.data.dataset import StagedDataset
from enn_core.predict.flow_steps import training_targets

N, LABELS = 200_000, 24  # the training rows' labels: 13 MB as float32, 27 MB as float64
CHUNK = LABELS * 4096  # label numbers a chunk (float64: 0.8 MB)
PEAK = 8 * 2**20


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.fixtures.data import run_stage

    root = tmp_path_factory.mktemp("labels")
    rng = np.random.default_rng(0)
    store = rng.integers(0, 50, N)
    labels = {f"h{h:02d}": (store + rng.normal(0, 5, N)).astype(np.float32) for h in range(LABELS)}
    table = pa.table({"store": pa.array([f"s{k}" for k in range(50)]).take(store), **labels})
    pq.write_table(table, root / "t.parquet")
    _, out = run_stage(
        root,
        source="parquet",
        path=str(root / "t.parquet"),
        feature_columns=("store",),
        categorical=("store",),
        cyclic=(),
        cyclic_periods=(),
        cyclic_starts=(),
        label_columns=tuple(labels),
        naive_keys=("store",),
    )
    return out


def _peak(fn):
    import pyarrow.compute  # noqa: F401 - imported before the count: modules are not rows

    tracemalloc.start()
    try:
        got = fn()
        return got, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_label_std_reads_the_training_labels_in_chunks(staged, monkeypatch):
    ds = StagedDataset(staged)
    monkeypatch.setattr(inference, "STD_CHUNK_CELLS", CHUNK, raising=False)
    got, peak = _peak(lambda: inference.label_std(ds))
    assert peak < PEAK, peak
    y = np.asarray(ds.targets[np.asarray(ds.split("train"))], np.float64)
    assert got == pytest.approx(float(np.std(y)), rel=1e-9)


def test_predict_check_reads_the_training_targets_in_chunks(staged, monkeypatch):
    monkeypatch.setattr(measures, "STD_CHUNK_CELLS", CHUNK)
    monkeypatch.setattr(reference, "RANGE_CHUNK_CELLS", CHUNK)
    got, peak = _peak(lambda: training_targets(staged))
    assert peak < PEAK, peak
    ds = StagedDataset(staged)
    y = np.asarray(ds.labels[np.sort(np.asarray(ds.split("train")))], np.float64)
    y = y.reshape(len(y), -1)
    np.testing.assert_allclose(got.spread, y.std(axis=0), rtol=1e-9)
    np.testing.assert_array_equal(got.low, y.min(axis=0))
    np.testing.assert_array_equal(got.high, y.max(axis=0))
