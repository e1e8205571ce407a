"""What export, predict's collapse check and the registry read of every training or validation
row's labels: chunks, not the rows at once (issue 51: at 10^7 rows a float64 copy of the
training labels is 1.5 GB, of the validation rows' errors per predictor 1.7 GB). The values
are the ones the whole arrays give."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from enn_core import inference
from enn_core.collapse import measures, reference
from enn_core.data.dataset import StagedDataset
from enn_core.paths import Layout
from enn_core.predict.flow_steps import training_targets
from tasks.tracking import registry
from tasks.tracking.champion_rule import row_errors

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


def test_registry_baseline_errors_are_made_in_chunks(staged, tmp_path, monkeypatch):
    """The champion rule's per-row errors of each naive predictor on the validation rows:
    a float64 a row each, the numbers of the whole arrays."""
    from enn_core.metrics import naive_predictions

    ds = StagedDataset(staged)
    rows = np.sort(np.asarray(ds.split("val")))
    from enn_core import baselines

    monkeypatch.setattr(registry, "ERROR_CHUNK_CELLS", CHUNK, raising=False)
    monkeypatch.setattr(baselines, "STAT_BYTES", 2**20)  # a median's block: 1 MB
    monkeypatch.setattr(baselines, "READ_CELLS", CHUNK)
    layout = Layout.for_root(tmp_path)
    got, peak = _peak(lambda: registry.baseline_errors(layout, staged, rows, None))
    # the naive predictors' fit (a group number a row and its chunks: under 12 MB, as
    # test_metrics bounds it) and a float64 a row per predictor; the whole arrays held 43 MB
    assert peak < 20 * 2**20, peak
    target = np.asarray(ds.targets[rows], np.float64)
    want = {n: row_errors(p, target) for n, p in naive_predictions(ds, rows).items()}
    assert list(got) == list(want)
    for n in want:
        np.testing.assert_array_equal(got[n], want[n])


def test_label_mode_reads_the_training_labels_in_chunks(staged, monkeypatch):
    """collapse-check's and enn doctor's majority value per output (issue 54)."""
    from enn_core.data import label_mode

    ds = StagedDataset(staged)
    train = ds.split("train")
    monkeypatch.setattr(label_mode, "MODE_CHUNK_CELLS", CHUNK)
    got, peak = _peak(lambda: label_mode.label_mode(ds.targets, train))
    assert peak < PEAK, peak
    whole = np.asarray(ds.targets[np.asarray(train)]).reshape(len(train), -1)
    most = max(np.unique(c, return_counts=True)[1].max() for c in whole.T) / len(whole)
    assert most <= 0.5 and not got.mostly_one_value and got.shares.max() <= 0.5
    # a label mostly zeros in those rows: its majority and share, exactly
    whole[: len(whole) * 3 // 4, 5] = 0.0
    got = label_mode.label_mode(whole, chunk_rows=CHUNK // LABELS)
    assert got.n_mostly == 1 and got.top == 5 and got.top_value == 0.0
    assert got.top_share == np.mean(whole[:, 5] == 0.0)


def test_prediction_plots_read_a_sample_of_the_rows(staged, tmp_path, monkeypatch):
    """The residual histogram MLflow shows reads at most PLOT_ROWS rows of the split (a seeded
    sample, said in its title): it read the labels, predictions and residuals of every row
    (0.4 GB at 10^7 rows). 30,000 test rows: 12.9 MB whole, 2.6 MB for a sample of 2,000."""
    from enn_core.stages import PREDICT, STAGE_DATA
    from tasks.tracking import plots

    layout = Layout.for_root(tmp_path)
    STAGE_DATA.output_dir(layout).parent.mkdir(parents=True)
    STAGE_DATA.output_dir(layout).symlink_to(staged, target_is_directory=True)
    test = np.asarray(StagedDataset(staged).split("test"))
    out = PREDICT.output_dir(layout)
    out.mkdir(parents=True)
    np.save(out / "predictions.npy", np.zeros((len(test), LABELS), np.float32))
    (out / "manifest.json").write_text('{"split": "test"}')
    monkeypatch.setattr(plots, "PLOT_ROWS", 2_000)
    plots._pyplot()
    got, peak = _peak(lambda: plots.prediction_plots(layout, tmp_path))
    assert [p.name for p in got] == ["residual_histogram.png"]
    assert peak < 5 * 2**20, peak
