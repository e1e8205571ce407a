"""The predict stage with more than one process: killed after chunk k, it resumes
bit-identical (the kill in a child process), and two workers give what one gives."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures.predict import PREDICT_BASE, copy_project, make_predict_project, run_predict
from tests.fixtures.project import ROOT

DRIVER = """
import sys
from enn_core.config import load_config
from enn_core.paths import Layout
from enn_core.stage import make_context
from enn_core.stages import PREDICT
root, overrides = sys.argv[1], sys.argv[2:]
cfg = load_config(None, overrides, allow_faults=True)
PREDICT.work(cfg, make_context(cfg, Layout.for_root(root), PREDICT, "r1"))
"""


@pytest.fixture(scope="module")
def base_project(tmp_path_factory) -> Path:
    return make_predict_project(tmp_path_factory.mktemp("project"))


@pytest.fixture
def project(base_project, tmp_path) -> Path:
    return copy_project(base_project, tmp_path / "p")


@pytest.mark.timeout(180)
def test_killed_after_chunk_k_resumes_bit_identical(project, tmp_path):
    reference = tmp_path / "ref"
    shutil.copytree(project, reference)
    run_predict(reference, "predict.split=all")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    fault = ["fault.kind=kill", "fault.phase=predict_chunk", "fault.step=4"]
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(project), *PREDICT_BASE, "predict.split=all", *fault],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not (project / "outputs/predict").exists()  # nothing published by the killed run
    parts = project / "work/predict-parts/predict"
    done = sorted(p.name for p in parts.glob("*.done"))
    assert done == [f"part-{k:05d}.done" for k in range(5)]

    s = run_predict(project, "predict.split=all")
    assert s.reused_parts == (0, 1, 2, 3, 4) and s.computed_parts == tuple(range(5, s.n_parts))
    assert s.discarded_parts is None
    for name in ("predictions.npy", "predictions.parquet"):
        a = (project / "outputs/predict" / name).read_bytes()
        assert a == (reference / "outputs/predict" / name).read_bytes(), name
    assert s.rows_computed == s.n_rows - 5 * 40


@pytest.mark.timeout(180)
def test_two_workers_equal_one(project, tmp_path):
    one = tmp_path / "one"
    shutil.copytree(project, one)
    run_predict(one, "predict.split=all")
    s = run_predict(project, "predict.split=all", "predict.world_size=2")
    assert s.world_size == 2 and s.computed_parts == tuple(range(s.n_parts))
    a = np.load(project / "outputs/predict/predictions.npy")
    np.testing.assert_array_equal(a, np.load(one / "outputs/predict/predictions.npy"))
