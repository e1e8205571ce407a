"""The pipeline past one machine, on local stand-ins: each command of docs/scale-out.md runs here.

- DVC experiments: `dvc exp run --temp -S ...` in DVC's temporary copy of the repository
  (paths resolve from that copy; the MLflow runs land in the parent's work/), `dvc exp show`,
  `dvc exp apply`, a workspace `dvc exp run -S train.epochs=...` that re-runs training only;
- a DVC remote (a local directory): `dvc push`, then `dvc pull` into an emptied cache;
- an MLflow server with a database backend (SQLite) and a proxied artifact store, the pipeline
  pointed at it by `tracking.uri` in params.yaml;
- a Prefect process work pool: `prefect work-pool create --type process`, a deployment of the
  training flow on it, `prefect worker start` running the triggered flow run.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import Project, make_project
from tests.e2e.test_daily_use import TWO, http

pytestmark = [pytest.mark.e2e]
TRAIN = ("stage-data", "prepare-checkpoint", "distributed-train")
# docs/scale-out.md's deployment command (`prefect deploy` of Prefect 3.8.8 creates the
# deployment, then fails on its own worker query: the server rejects its null limit)
DEPLOY_ON_POOL = (
    "from flows.training import training; "
    "training.from_source('$PWD', 'flows/training.py:training')"
    ".to_deployment('pooled', work_pool_name='enn-pool').apply()"
)


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _exp_rows(project: Project) -> dict[str, dict]:
    """`dvc exp show --json`: experiment name -> its data (params, metrics)."""
    rows = json.loads(project.run("dvc", "exp", "show", "--json").stdout)
    out = {}
    for baseline in rows:
        for exp in baseline.get("experiments") or []:
            for rev in exp["revs"]:
                out[rev["name"]] = rev["data"]
    return out


def _epochs(data: dict) -> tuple[int, int]:
    """(train.epochs param, epochs_run metric) of one `dvc exp show` row."""
    params = data["params"]["params.yaml"]["data"]["train"]["epochs"]
    metrics = data["metrics"]["outputs/metrics/distributed-train.json"]["data"]["epochs_run"]
    return params, metrics


@pytest.mark.timeout(900)
def test_experiments_temp_and_workspace_then_push_and_pull_a_local_remote(
    tmp_path, prefect_home_shared
):
    project = make_project(tmp_path / "proj", prefect_home_shared, stages=TRAIN)
    root = project.root

    # 1. in DVC's temporary copy: every stage runs there, the workspace stays as it was
    out = project.run("dvc", "exp", "run", "--temp", "-S", "train.epochs=1", timeout=600).stdout
    temp_name = re.search(r"Ran experiment\(s\): (\S+)", out).group(1)
    assert re.search(
        r"distributed-train: done in .* -> \S*/\.dvc/tmp/exps/\S*/outputs/distributed-train", out
    ), out
    assert not (root / "outputs" / "distributed-train").exists()
    assert yaml.safe_load((root / "params.yaml").read_text())["train"]["epochs"] == 20
    # the experiment's MLflow runs and run directories live in the parent's work/, not the copy
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'work' / 'mlflow' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("enn")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id], max_results=100)}
    assert {"stage-data", "prepare-checkpoint", "distributed-train"} <= set(runs)
    assert runs["distributed-train"].info.status == "FINISHED"
    assert any((root / "work" / "runs").glob("*/distributed-train/result.json"))

    # 2. apply it; a workspace experiment with another epoch count re-runs training only
    project.run("dvc", "exp", "apply", temp_name)
    out = project.run("dvc", "exp", "run", "-S", "train.epochs=2", timeout=600).stdout
    ws_name = re.search(r"Ran experiment\(s\): (\S+)", out).group(1)
    assert "Running stage 'distributed_train'" in out
    assert (
        "Running stage 'stage_data'" not in out and "Running stage 'prepare_checkpoint'" not in out
    )
    rows = _exp_rows(project)
    assert _epochs(rows[temp_name]) == (1, 1)
    assert _epochs(rows[ws_name]) == (2, 2)
    assert "val_mae" in project.run("dvc", "exp", "show", "--no-pager", "--md").stdout

    # 3. a DVC remote in a local directory: push, empty the cache and outputs, pull them back
    remote = tmp_path / "dvc-remote"
    project.run("dvc", "remote", "add", "-d", "store", str(remote))
    before = _hashes(root / "outputs")
    assert "files pushed" in project.run("dvc", "push").stdout
    assert any(p.is_file() for p in remote.rglob("*"))
    shutil.rmtree(root / ".dvc" / "cache")
    for stage in TRAIN:
        shutil.rmtree(root / "outputs" / stage)
    assert "not in cache" in project.run("dvc", "status").stdout
    project.run("dvc", "pull")
    assert _hashes(root / "outputs") == before
    assert "Data and pipelines are up to date" in project.run("dvc", "status").stdout


@pytest.mark.timeout(400)
def test_pipeline_logs_to_an_mlflow_server_with_a_database_backend(tmp_path, prefect_home_shared):
    from mlflow.tracking import MlflowClient

    from flows.servers import mlflow_server  # first: contains the environment before mlflow loads

    project = make_project(tmp_path / "proj", prefect_home_shared, stages=TWO)
    store = tmp_path / "mlflow-server"
    store.mkdir()
    db = f"sqlite:///{store / 'mlflow.db'}"
    with mlflow_server(db, store / "artifacts", "127.0.0.1", 0, store / "server.log") as url:
        project.set_params([f"tracking.uri={url}"])  # a config value, not an environment variable
        project.run("enn", "stage-data", timeout=300)
        exps = http(f"{url}/api/2.0/mlflow/experiments/search", {"max_results": 10})["experiments"]
        exp = next(e for e in exps if e["name"] == "enn")
        found = http(
            f"{url}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp["experiment_id"]]}
        )["runs"]
        stage = next(r for r in found if r["info"]["run_name"] == "stage-data")
        assert stage["info"]["status"] == "FINISHED"
        client = MlflowClient(tracking_uri=url)
        assert "manifest.json" in {a.path for a in client.list_artifacts(stage["info"]["run_id"])}
    # the server kept the runs in its database and the artifacts in its store, none locally
    assert (store / "mlflow.db").stat().st_size > 0
    assert list((store / "artifacts").rglob("manifest.json"))
    assert not (project.root / "work" / "mlflow" / "mlflow.db").exists()


@pytest.mark.timeout(500)
def test_a_prefect_process_worker_runs_the_training_flow_from_a_work_pool(
    tmp_path, prefect_home_shared, monkeypatch
):
    from flows.servers import prefect_server

    project = make_project(tmp_path / "proj", prefect_home_shared, stages=TWO)
    monkeypatch.setenv(
        "PREFECT_HOME", str(tmp_path / "prefect-server")
    )  # the server's own database
    with prefect_server("127.0.0.1", 0, tmp_path / "prefect-server.log") as api:
        project.env["PREFECT_API_URL"] = api
        project.run("prefect", "work-pool", "create", "enn-pool", "--type", "process")
        project.python(DEPLOY_ON_POOL.replace("$PWD", str(project.root)), timeout=300)
        out = project.run(
            "prefect", "deployment", "run", "training/pooled", "--param", "until=stage-data"
        ).stdout
        run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
        project.run("prefect", "worker", "start", "--pool", "enn-pool", "--run-once", timeout=400)
        run = http(f"{api}/flow_runs/{run_id}")
        assert run["state"]["type"] == "COMPLETED", run["state"]
        pool = http(f"{api}/deployments/{run['deployment_id']}")["work_pool_name"]
        assert pool == "enn-pool"
    assert (project.root / "outputs" / "stage-data" / "manifest.json").exists()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(
        tracking_uri=f"sqlite:///{project.root / 'work' / 'mlflow' / 'mlflow.db'}"
    )
    exp = client.get_experiment_by_name("enn")
    parents = client.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{run_id}'")
    assert parents and parents[0].info.status == "FINISHED"
