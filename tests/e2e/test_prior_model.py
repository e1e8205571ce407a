"""The network blended with its neighbour prior (model.prior_weight, what
configs/expressway.yaml uses) is one model like any other: `enn run` trains, validates,
collapse-checks, exports (ONNX and torch.export, parity checked) and registers it, and an MLflow
client gets the blend from the registered version (served from its ONNX file, no data read).

Starts from the session's trained project (tests/e2e/conftest.py), copied."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.fixtures.project import Project, copy_project

pytestmark = pytest.mark.timeout(900)
NAME = "enn-synthetic"
PRIOR = [
    "model.prior_weight=0.5",
    "model.prior_train=false",
    "model.prior_group=month",
    "model.prior_statistic=kriging+median",
    "train.epochs=12",
]


@dataclass
class Blended:
    project: Project
    out: str
    uri: str


@pytest.fixture(scope="module")
def blended(tmp_path_factory, trained_project) -> Blended:
    project = copy_project(trained_project.project, tmp_path_factory.mktemp("prior") / "proj")
    project.set_params(PRIOR)
    out = project.run("enn", "run", timeout=900)
    uri = f"sqlite:///{project.root / 'work' / 'mlflow' / 'mlflow.db'}"
    return Blended(project, out.stdout + out.stderr, uri)


def test_every_stage_runs_and_both_exports_match_the_blend(blended):
    root = blended.project.root
    init = json.loads((root / "outputs/prepare-checkpoint/init.json").read_text())
    prior = init["model"]["prior"]
    assert prior["weight"] == 0.5 and prior["training_rows"] > 0, init["model"]
    assert prior["statistic"] == "kriging+median", prior
    parity = json.loads((root / "outputs/export/parity.json").read_text())
    assert parity["onnx"]["ok"] and parity["torch_export"]["ok"], parity
    report = json.loads((root / "outputs/collapse-check/report.json").read_text())
    assert report["status"] == "passed", report.get("why")
    val = json.loads((root / "outputs/validate/metrics.json").read_text())
    assert np.isfinite(val["val/mae"]) and np.isfinite(val["test/mae"]), val
    assert "version 2:" in blended.out, blended.out[-1500:]


def test_a_client_gets_the_blend_from_the_registered_version(blended):
    import mlflow.pyfunc
    import pandas as pd

    from enn_core.checkpoint import load_model
    from enn_core.data.dataset import StagedDataset
    from enn_core.inference import PredictionPath, load_calibration
    from enn_core.serving import typed

    root = blended.project.root
    ds = StagedDataset(root / "outputs/stage-data")
    rows = np.asarray(ds.split("test"))[:6]
    frame = pd.DataFrame({k: ds.row_keys[k].to_numpy()[rows] for k in ds.manifest.row_keys})
    frame = typed(frame, ds.feature_specs)  # the signature's types: month "01" as 1
    mlflow.set_registry_uri(blended.uri)
    mlflow.set_tracking_uri(blended.uri)
    served = mlflow.pyfunc.load_model(f"models:/{NAME}/2").predict(frame).to_numpy()
    model, _ = load_model(root / "outputs/distributed-train/model.pt")
    assert model.prior is not None
    path = PredictionPath(model, load_calibration(root / "outputs/collapse-check")[0]).eval()
    x = torch.tensor(np.asarray(ds.features[rows], dtype=np.float32))
    with torch.no_grad():
        blend = path(x).reshape(len(rows), -1).numpy()
        network = model.denormalize(model.trunk(model.encoder(x))).reshape(len(rows), -1)
    np.testing.assert_allclose(served, blend, rtol=1e-4, atol=1e-3)
    assert np.abs(blend - network.numpy()).max() > 1e-2  # the prior is in what is served
