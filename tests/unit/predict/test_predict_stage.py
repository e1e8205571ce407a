"""The predict stage end to end on real staged data and a real (untrained) ENN checkpoint, in
one process (a killed run and two workers: tests/distributed/test_predict_stage.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from enn_core.checkpoint import load_model
from enn_core.config import load_config
from enn_core.data import staging
from enn_core.data.hashing import sha256_file
from enn_core.errors import DataError
from enn_core.fault import InjectedFault
from enn_core.inference import Calibration, write_calibration
from enn_core.paths import Layout
from enn_core.predict import model_io
from enn_core.stage import make_context
from enn_core.stages import PREDICT, PREPARE_CHECKPOINT
from tests.fixtures.predict import (
    PREDICT_BASE,
    copy_project,
    make_predict_project,
    predict_cfg,
    run_predict,
)


@pytest.fixture(scope="module")
def base_project(tmp_path_factory) -> Path:
    return make_predict_project(tmp_path_factory.mktemp("project"))


@pytest.fixture
def project(base_project, tmp_path) -> Path:
    return copy_project(base_project, tmp_path / "p")


def _model_predict(root: Path, rows=None) -> np.ndarray:
    model, _ = load_model(root / "outputs/prepare-checkpoint/init.pt")
    x = np.load(root / "outputs/stage-data/features.npy")
    x = x if rows is None else x[rows]
    with torch.no_grad():
        return model.predict(torch.from_numpy(np.asarray(x, dtype=np.float32))).numpy()


def test_predicts_a_split_in_real_units_with_keyed_parquet(project):
    s = run_predict(project, "predict.split=test")
    out = project / "outputs/predict"
    test_rows = np.load(project / "outputs/stage-data/splits/test.npy")
    pred = np.load(out / "predictions.npy")
    assert pred.shape == (len(test_rows), 4, 6) and s.n_rows == len(test_rows)
    np.testing.assert_allclose(pred, _model_predict(project, test_rows), rtol=1e-5, atol=1e-4)
    table = pq.read_table(out / "predictions.parquet").to_pandas()
    keys = (
        pq.read_table(project / "outputs/stage-data/row_keys.parquet").to_pandas().iloc[test_rows]
    )
    assert table["row"].tolist() == test_rows.tolist()
    for k in ("month", "daytype", "direction"):
        assert table[k].tolist() == keys[k].tolist()
    np.testing.assert_array_equal(table.iloc[:, -24:].to_numpy().reshape(pred.shape), pred)
    manifest = json.loads((out / "manifest.json").read_text())
    assert (
        manifest["calibration"]["applied"] is False
        and "collapse-check" in manifest["calibration"]["reason"]
    )
    assert manifest["files"]["predictions.npy"] == sha256_file(out / "predictions.npy")
    assert s.computed_parts == tuple(range(s.n_parts)) and s.reused_parts == ()
    assert not (project / "work/predict-parts/predict").exists()  # parts removed once published


def test_parts_of_another_model_are_discarded_with_a_message(project, caplog):
    caplog.set_level(logging.INFO, logger="enn_core.predict.chunks")
    parts = project / "work/predict-parts/predict"
    layout = Layout.for_root(project)
    fault = ["fault.kind=raise", "fault.phase=predict_chunk", "fault.step=1"]
    cfg = load_config(None, [*PREDICT_BASE, "predict.split=all", *fault], allow_faults=True)
    with pytest.raises(InjectedFault):
        PREDICT.work(cfg, make_context(cfg, layout, PREDICT, "r1"))
    assert len(list(parts.glob("*.done"))) == 2
    other = predict_cfg("predict.split=all", "model.init_seed=7")
    PREPARE_CHECKPOINT.work(
        other, make_context(other, layout, PREPARE_CHECKPOINT, "r2")
    )  # new weights
    s = PREDICT.work(other, make_context(other, layout, PREDICT, "r2"))
    assert "model_fingerprint" in s.discarded_parts and s.reused_parts == ()
    # said once on the console (the stage's warning); the folder in the log file only
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("discard" in m for m in warned) == 1, warned
    assert "discarding parts in" in caplog.text
    np.testing.assert_allclose(
        np.load(project / "outputs/predict/predictions.npy"),
        _model_predict(project),
        rtol=1e-5,
        atol=1e-4,
    )


def test_a_part_forged_on_the_one_worker_path_is_recomputed_not_published(
    project, monkeypatch, caplog
):
    """One node, one worker, no job secret exported: the parts' markers still carry an HMAC
    (the work directory's own secret, made 0600). A part rewritten by anyone who can write the
    parts folder, its marker's sha256 recomputed, is recomputed: it was published (exit 0,
    every cell 12345.0)."""
    import hashlib
    import io
    import stat

    monkeypatch.delenv("ENN_JOB_SECRET_FILE", raising=False)
    parts = project / "work/predict-parts/predict"
    layout = Layout.for_root(project)
    fault = ["fault.kind=raise", "fault.phase=predict_chunk", "fault.step=1"]
    cfg = load_config(None, [*PREDICT_BASE, "predict.split=all", *fault], allow_faults=True)
    with pytest.raises(InjectedFault):
        PREDICT.work(cfg, make_context(cfg, layout, PREDICT, "r1"))
    part, marker = parts / "part-00000.npy", parts / "part-00000.done"
    forged = np.full_like(np.load(part), 12345.0)
    raw = io.BytesIO()
    np.save(raw, forged)
    part.write_bytes(raw.getvalue())
    record = json.loads(marker.read_text())
    record["sha256"] = hashlib.sha256(raw.getvalue()).hexdigest()
    marker.write_text(json.dumps(record))
    caplog.set_level(logging.WARNING, logger="enn.predict")
    s = run_predict(project, "predict.split=all")
    assert 0 in s.computed_parts and s.reused_parts == (1,)
    assert "part 0" in caplog.text and "fails its MAC" in caplog.text
    pred = np.load(project / "outputs/predict/predictions.npy")
    assert not (pred == 12345.0).any()
    np.testing.assert_allclose(pred, _model_predict(project), rtol=1e-5, atol=1e-4)
    assert stat.S_IMODE((project / "work/job-secret").stat().st_mode) == 0o600


def test_calibration_applies_only_to_its_model(project):
    model_path = project / "outputs/prepare-checkpoint/init.pt"
    raw = _model_predict(project)
    slope = np.full(raw.shape[1:], 0.5, dtype=np.float32)
    intercept = np.full(raw.shape[1:], 10.0, dtype=np.float32)
    cal_dir = project / "outputs/collapse-check"
    cal_dir.mkdir(parents=True)
    write_calibration(
        cal_dir,
        Calibration("calibrated", "fp32", slope, intercept),
        {"model_sha256": sha256_file(model_path)},
    )
    s = run_predict(project, "predict.split=all")
    assert s.calibration["applied"] and s.calibration["candidate"] == "calibrated"
    pred = np.load(project / "outputs/predict/predictions.npy")
    np.testing.assert_allclose(pred, raw * 0.5 + 10.0, rtol=1e-5, atol=1e-4)

    write_calibration(
        cal_dir, Calibration("calibrated", "fp32", slope, intercept), {"model_sha256": "0" * 64}
    )
    s = run_predict(project, "predict.split=all")
    assert (
        not s.calibration["applied"]
        and s.calibration["reason"]
        == "collapse-check has not judged this model yet (collapse-check/calibration.json is "
        f"an earlier model's, 000000000000; this one is {sha256_file(model_path)[:12]})"
    )
    # predict's console line keeps the reason's head; the summary above keeps the hashes
    choice = model_io.choose_calibration(cal_dir, sha256_file(model_path))
    assert choice.headline == "collapse-check has not judged this model yet", choice
    np.testing.assert_allclose(
        np.load(project / "outputs/predict/predictions.npy"), raw, rtol=1e-5, atol=1e-4
    )


def test_features_only_input_and_schema_refusal(project):
    cfg = predict_cfg()
    layout = Layout.for_root(project)
    staging.stage_features(
        cfg.data, layout, project / "new", project / "outputs/stage-data/manifest.json"
    )
    s = run_predict(project, "predict.input_dir=new")
    assert s.selection == "all rows of the features-only dataset"
    pred = np.load(project / "outputs/predict/predictions.npy")
    np.testing.assert_allclose(pred, _model_predict(project), rtol=1e-5, atol=1e-4)
    before = sha256_file(project / "outputs/predict/predictions.npy")

    m = json.loads((project / "new/manifest.json").read_text())
    m["feature_specs"] = m["feature_specs"][::-1]
    (project / "new/manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="but the model expects the order") as e:
        run_predict(project, "predict.input_dir=new")
    assert "\n" not in str(e.value)
    assert (
        sha256_file(project / "outputs/predict/predictions.npy") == before
    )  # earlier output untouched


def test_a_lying_calibration_file_is_shown_never_run_by_the_terminal(tmp_path):
    """calibration.json is a file: a terminal escape sequence in its candidate or model field
    reaches predict's console line and summary as printable text."""
    from enn_core.inference import CALIBRATION_FILE

    sha = "a" * 64
    (tmp_path / CALIBRATION_FILE).write_text(
        json.dumps({"model_sha256": "\x1b]0;owned\x07" + "b" * 60, "candidate": "raw"})
    )
    other = model_io.choose_calibration(tmp_path, sha)
    assert not other.applied and "\x1b" not in other.reason and "\\x1b" in other.reason
    (tmp_path / CALIBRATION_FILE).write_text(
        json.dumps({"model_sha256": sha, "candidate": "\x1b[2Jcalibrated"})
    )
    mine = model_io.choose_calibration(tmp_path, sha)
    assert "\x1b" not in mine.candidate and mine.candidate.startswith("\\x1b"), mine
