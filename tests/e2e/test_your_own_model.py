"""Your own nn.Module through the whole pipeline: examples/tcn (a temporal convolution over
the hours) as `model.preset: custom`, trained by `enn run` with two FSDP2 workers, validated,
collapse-checked, exported (ONNX and torch.export, parity checked), registered in MLflow,
called through `mlflow.pyfunc`, used by the prediction flow, and known to DVC: editing the
module makes the stages that build the model stale, and `dvc repro` re-trains it.

Starts from the session's trained project (tests/e2e/conftest.py), copied."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.fixtures.project import Project, copy_project

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[2]
TCN = "examples.tcn.model:build"
NAME = "enn-synthetic"
MODEL_STAGES = ("prepare_checkpoint", "distributed_train")


@dataclass
class Custom:
    project: Project
    refused: str  # what `enn run` said before dvc.yaml knew the model's code
    out: str  # what the training run printed
    uri: str


@pytest.fixture(scope="module")
def custom(tmp_path_factory, trained_project) -> Custom:
    project = copy_project(trained_project.project, tmp_path_factory.mktemp("own") / "proj")
    root = project.root
    shutil.copytree(ROOT / "examples", root / "examples", ignore=shutil.ignore_patterns("__py*"))
    project.set_params(
        [
            "model.preset=custom",
            f"model.factory={TCN}",
            "model.options={channels: 8, layers: 2}",
            "runtime.world_size=2",  # two FSDP2 workers
        ]
    )
    # DVC does not know the model's code yet: the stage that builds the model refuses, one line
    refused = project.run("enn", "run", check=False, timeout=600)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    dvc = yaml.safe_load((root / "dvc.yaml").read_text())
    for key in MODEL_STAGES:
        dvc["stages"][key]["deps"].append("examples/tcn")
    (root / "dvc.yaml").write_text(yaml.safe_dump(dvc, sort_keys=False))
    project.git_commit("your own model")
    out = project.run("enn", "run", timeout=900)
    uri = f"sqlite:///{root / 'work' / 'mlflow' / 'mlflow.db'}"
    return Custom(project, refused.stdout + refused.stderr, out.stdout + out.stderr, uri)


def test_dvc_must_know_the_code_before_anything_runs(custom):
    lines = [ln for ln in custom.refused.splitlines() if "not depend on" in ln]
    assert (
        lines
        and "stages prepare_checkpoint, distributed_train do not depend on examples/tcn/model.py"
        in lines[0]
    ), custom.refused[-1500:]
    assert "Traceback" not in custom.refused


def test_two_workers_train_it_and_every_stage_runs(custom):
    root = custom.project.root
    record = json.loads((root / "outputs/distributed-train/record.json").read_text())
    assert record["world_size"] == 2 and record["wrap"] == "fsdp2", record
    assert sorted(record["rank_phases"]) == ["0", "1"], record
    init = json.loads((root / "outputs/prepare-checkpoint/init.json").read_text())
    assert TCN in json.dumps(init), init
    parity = json.loads((root / "outputs/export/parity.json").read_text())
    assert (root / "outputs/export/model.onnx").is_file()
    assert (root / "outputs/export/model.pt2").is_file()
    assert parity["onnx"]["ok"] and parity["torch_export"]["ok"], parity
    report = json.loads((root / "outputs/collapse-check/report.json").read_text())
    assert report["status"] == "passed", report.get("why")
    val = json.loads((root / "outputs/validate/metrics.json").read_text())
    assert np.isfinite(val["val/mae"]) and np.isfinite(val["test/mae"]), val


def test_registered_and_callable_by_any_mlflow_client(custom):
    import mlflow.pyfunc
    import pandas as pd
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=custom.uri, registry_uri=custom.uri)
    versions = client.search_model_versions(f"name='{NAME}'")
    latest = max(versions, key=lambda v: int(v.version))
    assert int(latest.version) == 2, [v.version for v in versions]  # 1: the template's ENN
    assert "version 2:" in custom.out, custom.out[-1500:]
    sys.modules.pop("examples.tcn.model", None)
    mlflow.set_registry_uri(custom.uri)
    mlflow.set_tracking_uri(custom.uri)
    model = mlflow.pyfunc.load_model(f"models:/{NAME}/2")
    frame = pd.DataFrame({"month": [1, 4], "daytype": ["sun", "mon"], "direction": ["up", "down"]})
    out = model.predict(frame)  # served from model.onnx: none of the user's code is imported
    assert out.shape[0] == 2 and all("|" in c for c in out.columns)
    assert np.isfinite(out.to_numpy()).all()
    assert "examples.tcn.model" not in sys.modules


def test_the_prediction_flow_uses_it_only_when_the_params_trust_its_code(custom):
    project = custom.project
    model = f"models:/{NAME}/2"
    refused = project.run("enn", "run", "--flow", "prediction", "--model", model, check=False)
    assert refused.returncode == 4, refused.stdout[-1500:] + refused.stderr[-1500:]
    said = refused.stdout + refused.stderr
    assert f"built by model.factory {TCN!r}" in said and "Traceback" not in said
    project.run(
        "enn", "run", "--flow", "prediction", "--model", model, "--set", f"model.factory={TCN}"
    )
    pred = project.root / "prediction/outputs/predict/predictions.npy"
    assert pred.is_file() and np.isfinite(np.load(pred)).all()


def test_editing_the_model_makes_training_stale_in_dvc(custom):
    project = custom.project
    before = json.loads(project.run("dvc", "status", "--json").stdout)
    assert not set(MODEL_STAGES) & set(before), before  # enn run recorded them in dvc.lock
    code = project.root / "examples/tcn/model.py"
    code.write_text(code.read_text() + "\n# an edit\n")
    status = project.run("dvc", "status", "--json").stdout
    stale = json.loads(status)
    assert {"prepare_checkpoint", "distributed_train"} <= set(stale), stale
    assert all(any("examples/tcn" in json.dumps(c) for c in stale[k]) for k in MODEL_STAGES)
    # dvc repro re-trains the edited model (two workers) and leaves the pipeline up to date
    out = project.run("dvc", "repro", timeout=900).stdout
    for key in MODEL_STAGES:
        assert f"Running stage '{key}'" in out, out[-2000:]
    record = json.loads((project.root / "outputs/distributed-train/record.json").read_text())
    assert record["world_size"] == 2 and record["wrap"] == "fsdp2", record
    # (prediction/dvc.yaml, which reads the new collapse-check, is stale now: that is its job)
    after = json.loads(project.run("dvc", "status", "dvc.yaml", "--json").stdout)
    assert not after, after
