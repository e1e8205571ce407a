"""The pipeline past one machine, on local stand-ins: each command of docs/scale-out.md runs here.

- DVC experiments: `dvc exp run --temp -S ...` in DVC's temporary copy of the repository
  (paths resolve from that copy; the MLflow runs land in the parent's work/), `dvc exp show`,
  `dvc exp apply`, a workspace `dvc exp run -S train.lr=...` that re-runs training and validate
  only, and `dvc exp show --only-changed` in 120 columns (the learning rate and both MAEs);
- a DVC remote (a local directory): `dvc push`, then `dvc pull` into an emptied cache;
- a Prefect process work pool (`prefect work-pool create --type process`, a deployment of the
  training flow on it, `prefect worker start` running the triggered flow run) with an MLflow
  server on a database backend (SQLite) and a proxied artifact store, both pipelines pointed at
  it by `tracking.uri`: runs, the registered champion, and the prediction flow's `models:/`.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import socket
from pathlib import Path

import pytest
import yaml

from enn_core.stages import TRAINING
from tests.e2e.test_daily_use import http
from tests.fixtures.project import Project, make_project

TRAIN = ("stage-data", "prepare-checkpoint", "distributed-train")
# docs/scale-out.md's deployment command (`prefect deploy` of Prefect 3.8.8 creates the
# deployment, then fails on its own worker query: the server rejects its null limit)
# a line of Prefect's console handler about a flow or task run ("12:00:01.123 | INFO    | Flow
# run 'x' - Beginning flow run ...")
PREFECT_RUN_LINE = re.compile(r"\| INFO +\| (Flow run|Task run) '")
DEPLOY_ON_POOL = (
    "from flows.training import training, POOL_JOB_VARIABLES as jv; "
    "training.from_source('$PWD', 'flows/training.py:training')"
    ".to_deployment('pooled', work_pool_name='enn-pool', job_variables=jv).apply()"
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


def _lr(data: dict) -> tuple[float, int]:
    """(train.lr param, epochs_run metric) of one `dvc exp show` row."""
    params = data["params"]["params.yaml"]["data"]["train"]["lr"]
    metrics = data["metrics"]["outputs/metrics/distributed-train.json"]["data"]["train/epochs_run"]
    return params, metrics


@pytest.mark.timeout(900)
def test_experiments_temp_and_workspace_then_push_and_pull_a_local_remote(
    tmp_path, prefect_home_shared
):
    project = make_project(tmp_path / "proj", prefect_home_shared, stages=(*TRAIN, "validate"))
    root = project.root
    project.set_params(["train.epochs=2"])  # two cheap trainings
    project.git_commit("two epochs")

    # 1. in DVC's temporary copy: every stage runs there, the workspace stays as it was
    out = project.run("dvc", "exp", "run", "--temp", "-S", "train.lr=0.005", timeout=600).stdout
    temp_name = re.search(r"Ran experiment\(s\): (\S+)", out).group(1)
    assert re.search(
        r"distributed-train: done in .* -> \S*/\.dvc/tmp/exps/\S*/outputs/distributed-train", out
    ), out
    assert not (root / "outputs" / "distributed-train").exists()
    assert yaml.safe_load((root / "params.yaml").read_text())["train"]["lr"] == 0.01
    # the experiment's MLflow runs and run directories live in the parent's work/, not the copy
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'work' / 'mlflow' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("enn")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id], max_results=100)}
    assert {"stage-data", "prepare-checkpoint", "distributed-train"} <= set(runs)
    assert runs["distributed-train"].info.status == "FINISHED"
    assert any((root / "work" / "runs").glob("*/distributed-train/result.json"))

    # 2. apply and commit it; a workspace experiment with another learning rate re-runs
    # training and validate only
    project.run("dvc", "exp", "apply", temp_name)
    project.git_commit("lr 0.005")
    out = project.run("dvc", "exp", "run", "-S", "train.lr=0.02", timeout=600).stdout
    ws_name = re.search(r"Ran experiment\(s\): (\S+)", out).group(1)
    assert "Running stage 'distributed_train'" in out and "Running stage 'validate'" in out
    assert (
        "Running stage 'stage_data'" not in out and "Running stage 'prepare_checkpoint'" not in out
    )
    rows = _exp_rows(project)
    assert _lr(rows[ws_name]) == (0.02, 2)
    assert "train/epochs_run" in project.run("dvc", "exp", "show", "--no-pager", "--md").stdout
    # issue 32: docs/getting-started.md's `dvc exp show --only-changed` in a 120-column terminal
    # shows the learning rate and the validation and test MAE of both rows (it showed two
    # metrics, "…")
    wide = Project(root, {**project.env, "COLUMNS": "120"})
    out = wide.run("dvc", "exp", "show", "--only-changed", "--no-pager").stdout
    widths = [len(line) for line in out.splitlines()]
    assert widths and max(widths) <= 120, out
    head = next(line for line in out.splitlines() if "Experiment" in line).split()
    assert {"train.lr", "val/mae", "test/mae"} <= set(head), out
    assert ws_name in out and re.search(r"0\.02\b", out) and re.search(r"0\.005\b", out), out

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


@pytest.mark.timeout(900)
def test_a_prefect_worker_runs_the_training_flow_logging_to_an_mlflow_server(
    tmp_path, prefect_home_shared, monkeypatch
):
    """A process work pool's worker runs the seven stages; runs, artifacts and the registered
    model go to an MLflow server on SQLite; the prediction flow takes the champion from it."""
    from flows.params_file import apply_overrides
    from flows.servers import mlflow_server, prefect_server

    project = make_project(tmp_path / "proj", prefect_home_shared)
    root = project.root
    store = tmp_path / "mlflow-server"
    store.mkdir()
    monkeypatch.setenv(
        "PREFECT_HOME", str(tmp_path / "prefect-server")
    )  # the server's own database
    with (
        mlflow_server(
            f"sqlite:///{store / 'mlflow.db'}",
            store / "artifacts",
            "127.0.0.1",
            0,
            store / "server.log",
        ) as url,
        prefect_server("127.0.0.1", 0, tmp_path / "prefect-server.log") as api,
    ):
        # the tracking server is a config value of each pipeline, not an environment variable
        project.set_params([f"tracking.uri={url}"])
        apply_overrides(root / "prediction" / "params.yaml", [f"tracking.uri={url}"])
        project.env["PREFECT_API_URL"] = api
        project.run("prefect", "work-pool", "create", "enn-pool", "--type", "process")
        project.python(DEPLOY_ON_POOL.replace("$PWD", str(root)), timeout=300)
        # a deployment run with overrides (issue 39: it rewrote the worker's params.yaml,
        # "train.epochs: 25 -> 2", and pooled checkouts drifted from their commit)
        params = (root / "params.yaml").read_bytes()
        sets = json.dumps({"overrides": ["train.epochs=12"]})
        out = project.run("prefect", "deployment", "run", "training/pooled", "--params", sets)
        run_id = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout).group(1)
        worker = project.run(
            "prefect", "worker", "start", "--pool", "enn-pool", "--run-once", timeout=600
        )
        run = http(f"{api}/flow_runs/{run_id}")
        said = worker.stdout + worker.stderr
        assert run["state"]["type"] == "COMPLETED", (run["state"], said[-5000:])
        assert (root / "params.yaml").read_bytes() == params  # no tracked file written
        assert not (root / "dvc.lock").exists()  # DVC neither skipped nor recorded the run
        assert "train.epochs=12 for this run only (a deployment's run never writes" in said, said
        (tmp_path / "worker.out").write_text(said)  # what the worker's terminal showed
        # issue 39: the flow run's process prints the project's lines, not Prefect's INFO
        # lines about the flow and task runs ("Beginning flow run ...", "Finished in state ...")
        prefects = [line for line in said.splitlines() if PREFECT_RUN_LINE.search(line)]
        assert not prefects, "\n".join(prefects)
        assert http(f"{api}/deployments/{run['deployment_id']}")["work_pool_name"] == "enn-pool"

        # the server holds the flow run's MLflow runs (REST) and the registered champion
        exps = http(f"{url}/api/2.0/mlflow/experiments/search", {"max_results": 10})["experiments"]
        exp = next(e for e in exps if e["name"] == "enn")
        found = http(
            f"{url}/api/2.0/mlflow/runs/search",
            {
                "experiment_ids": [exp["experiment_id"]],
                "filter": f"tags.`prefect.flow_run_id` = '{run_id}'",
            },
        )["runs"]
        names = {r["info"]["run_name"] for r in found}
        # on a tracking server (several machines may share it) the run names its host
        parent = f"training #1 @{socket.gethostname()} synthetic train.epochs=12"
        assert names == {parent, *(s.name for s in TRAINING)}, names
        assert {r["info"]["status"] for r in found} == {"FINISHED"}
        from mlflow.tracking import MlflowClient  # telemetry off: tests/conftest.py

        client = MlflowClient(tracking_uri=url, registry_uri=url)
        champion = client.get_model_version_by_alias("enn-synthetic", "champion")
        assert champion.tags["prefect.flow_run_id"] == run_id

        project.run(
            "enn",
            "run",
            "--flow",
            "prediction",
            "--model",
            "models:/enn-synthetic@champion",
            timeout=600,
        )
        assert (
            root / "prediction" / "model" / "SOURCE"
        ).read_text().strip() == "models:/enn-synthetic@champion"
        assert (root / "prediction" / "outputs" / "predict" / "predictions.npy").exists()
    # the server kept the runs in its database and the artifacts in its store, none locally
    assert list((store / "artifacts").rglob("model.onnx"))
    assert not (root / "work" / "mlflow" / "mlflow.db").exists()
