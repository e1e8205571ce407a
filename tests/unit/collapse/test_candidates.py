"""collapse-check's candidates on tiny models with known faults: each is caught, and the
right candidate (or none) is chosen, for the right reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from enn_core.collapse.candidates import check_candidates
from enn_core.collapse.measures import column_std, measure_predictions, target_spread
from enn_core.inference import PredictionPath
from tests.fixtures.evaluate import (
    BatchBroadcast,
    Compressed,
    Constant,
    Flat,
    Generator,
    Quantized,
    check_rows,
    collapse_cfg,
)

pytestmark = pytest.mark.timeout(60)


def test_constant_model_fails_every_candidate():
    report, cal = check_candidates(Constant(), check_rows(), collapse_cfg(), "fp32")
    assert cal is None and report.status == "failed" and report.chosen is None
    raw = report.candidates["raw"]
    assert raw.measures["spread_median"] == 0.0 and raw.measures["broadcast_fraction"] == 1.0
    assert raw.distance > 0.9  # far from passing, and the report says how far
    assert report.candidates["fp32"].status == "not_applicable"
    assert "every candidate collapsed" in report.why


def test_healthy_model_passes_raw():
    report, cal = check_candidates(Generator(), check_rows(), collapse_cfg(), "fp32")
    assert report.chosen == "raw" and cal.candidate == "raw" and cal.slope is None
    m = report.candidates["raw"].measures
    assert (
        m["spread_median"] > 0.9
        and m["broadcast_fraction"] == 0.0
        and m["correlation_median"] > 0.9
    )
    assert not report.cause.batch_dependent
    assert report.chosen_metrics["val/mae"] < report.chosen_metrics["val/naive_conditional_mae"]


def test_batch_broadcast_bug_is_caught_and_per_sample_wins():
    report, cal = check_candidates(BatchBroadcast(), check_rows(), collapse_cfg(), "fp32")
    raw = report.candidates["raw"]
    assert raw.status == "failed" and raw.measures["broadcast_fraction"] == 1.0
    assert report.candidates["calibrated"].status == "failed"  # nothing to stretch
    assert report.chosen == "per_sample" and cal.candidate == "per_sample"
    assert report.cause.batch_dependent and "batch-level broadcast" in report.cause.diagnosis
    # the chosen path really is correct row by row, whatever the batch
    x = torch.from_numpy(check_rows().features)
    with torch.no_grad():
        torch.testing.assert_close(PredictionPath(BatchBroadcast(), cal)(x), Generator().predict(x))


def test_compressed_model_is_rescued_by_calibration():
    rows = check_rows()
    report, cal = check_candidates(Compressed(), rows, collapse_cfg(), "fp32")
    assert report.candidates["raw"].status == "failed"
    assert report.chosen == "calibrated" and cal.slope is not None
    c = report.candidates["calibrated"]
    assert (
        c.measures["correlation_median"] > 0.9 and c.measures["mae"] < c.measures["naive_best_mae"]
    )
    assert 2.0 < c.slope["median"] < 3.0
    assert "under-dispersed" in report.cause.diagnosis
    # the calibrated path (fitted on all validation rows) undoes the compression
    with torch.no_grad():
        got = PredictionPath(Compressed(), cal)(torch.from_numpy(rows.features)).numpy()
    assert np.abs(got - rows.target).mean() < 0.5


def test_flat_model_is_not_rescued_by_calibration():
    for slope_max in (3.0, 1e9):  # even an unbounded stretch does not pass: skill is judged too
        report, cal = check_candidates(
            Flat(), check_rows(), collapse_cfg(calibration_slope_max=slope_max), "fp32"
        )
        assert cal is None and report.status == "failed"
        c = report.candidates["calibrated"]
        failing = {x.measure for x in c.criteria if not x.ok}
        assert c.status == "failed" and {"spread_median", "correlation_median"} <= failing
        assert report.candidates["raw"].measures["flat_fraction"] == 1.0
        assert "collapsed" in report.cause.diagnosis


def test_reduced_precision_collapse_is_rescued_by_fp32():
    report, cal = check_candidates(Quantized(), check_rows(), collapse_cfg(), "bf16")
    assert report.candidates["raw"].status == "failed"
    assert report.chosen == "fp32" and cal.precision == "fp32"
    assert report.cause.precision_effect > 0.1 and "reduced precision" in report.cause.diagnosis


def test_order_decides_between_passing_candidates():
    report, cal = check_candidates(
        Generator(), check_rows(), collapse_cfg(order=("per_sample", "raw")), "fp32"
    )
    assert report.candidates["raw"].status == "passed" and report.chosen == "per_sample"


def test_measure_without_targets_uses_training_spread():
    rows = check_rows()
    train_spread = target_spread(rows.target)
    with torch.no_grad():
        healthy = Generator().predict(torch.from_numpy(rows.features)).numpy()
        constant = Constant().predict(torch.from_numpy(rows.features)).numpy()
    ok = measure_predictions(
        healthy, train_spread, collapse_cfg(), features=rows.features, label_std=rows.label_std
    )
    bad = measure_predictions(
        constant, train_spread, collapse_cfg(), features=rows.features, label_std=rows.label_std
    )
    assert not ok["collapsed"] and bad["collapsed"]
    assert (
        any("spread_median" in r for r in bad["reasons"])
        and bad["measures"]["broadcast_fraction"] == 1.0
    )
    # values are reported as they are: nothing nudges tied outputs apart
    assert np.unique(constant.reshape(len(constant), -1), axis=0).shape[0] == 1


def test_spread_of_a_large_memmap_is_read_in_chunks(tmp_path):
    rng = np.random.default_rng(0)
    a = (1000 + rng.standard_normal((1000, 3, 4))).astype(np.float32)
    np.save(tmp_path / "p.npy", a)
    mm = np.load(tmp_path / "p.npy", mmap_mode="r")
    np.testing.assert_allclose(
        column_std(mm, chunk_rows=7), a.astype(np.float64).reshape(1000, -1).std(axis=0), rtol=1e-9
    )
