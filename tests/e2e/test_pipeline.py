"""The whole pipeline, once, watched: the training flow on synthetic data with 2 CPU workers,
`dvc repro` twice, the prediction flow on the registered champion, and `dvc repro` of the
prediction pipeline. Every Python process it starts loads tests/e2e/netguard (no connection
or DNS lookup to a non-loopback address; a marker per process proves it was watched).

The module fixture runs everything once; each test checks one property of the result.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.fixtures.project import Project, make_project

pytestmark = pytest.mark.timeout(1500)
GUARD = Path(__file__).parent / "netguard"
# Local tools a library may run (platform probes, compilers, git): none of them opens a socket.
NON_PYTHON_OK = {
    # matplotlib's font manager lists the system's fonts once per MPLCONFIGDIR where fontconfig
    # is installed (a local query, no socket)
    "fc-list",
    "sh",
    "bash",
    "dash",
    "git",
    "uname",
    "ldconfig",
    "gcc",
    "cc",
    "cc1",
    "as",
    "ld",
    "collect2",
    "file",
    "lscpu",
    "getconf",
    "nproc",
    "which",
    "hostname",
    "id",
    "ps",
    "cat",
    "env",
}


class TreeWatcher:
    """Polls the descendants of this process and remembers every one it saw: its name, command
    line and parent, as last seen (a child caught between fork and exec shows its parent's
    command line; a later poll shows what it became)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[str, list[str], int]] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    def _loop(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(0.1):
            for p in me.children(recursive=True):
                try:
                    self.seen[p.pid] = (p.name(), p.cmdline(), p.ppid())
                except psutil.Error:
                    continue


@dataclass
class Ran:
    project: Project
    guard_dir: Path
    tree: dict
    outputs: dict = field(default_factory=dict)


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> Ran:
    tmp = tmp_path_factory.mktemp("pipeline")
    guard_dir = tmp / "netguard-out"
    project = make_project(tmp / "proj", tmp / "prefect-home")
    project.env["PYTHONPATH"] = f"{GUARD}:{project.root}"
    project.env["ENN_NETGUARD_DIR"] = str(guard_dir)
    project.set_params(["runtime.world_size=2"])
    project.git_commit("two workers")
    result = Ran(project, guard_dir, {})
    with TreeWatcher() as tree:
        result.outputs["flow"] = project.run("enn", "run", timeout=1200).stdout
        result.outputs["git_after_flow"] = git_changes(project)  # the Quick start's first half
        result.outputs["repro1"] = project.run("dvc", "repro", timeout=600).stdout
        result.outputs["repro2"] = project.run("dvc", "repro", timeout=600).stdout
        # a change in the inference code: dvc repro runs validate, predict, collapse-check, export
        with open(project.root / "enn_core" / "inference.py", "a") as f:
            f.write("\n# touched by the test\n")
        result.outputs["repro3"] = project.run("dvc", "repro", timeout=900).stdout
        # no --model: this task's champion (models:/enn-synthetic@champion)
        result.outputs["git_before_predict_flow"] = git_changes(project)
        result.outputs["predict_flow"] = project.run(
            "enn", "run", "--flow", "prediction", timeout=900
        ).stdout
        result.outputs["git_after_predict_flow"] = git_changes(project)
        result.outputs["predict_repro"] = project.run(
            "dvc", "repro", cwd=project.root / "prediction", timeout=600
        ).stdout
        # a predict param: dvc re-runs predict and collapse-check
        from flows.params_file import apply_overrides

        apply_overrides(project.root / "prediction" / "params.yaml", ["predict.chunk_rows=7"])
        result.outputs["predict_repro2"] = project.run(
            "dvc", "repro", cwd=project.root / "prediction", timeout=600
        ).stdout
        # importing more code (the prediction flow) must not make the training pipeline stale
        result.outputs["status_after"] = project.run("dvc", "status", "dvc.yaml").stdout
        # the experiments tables: the training project's, and the prediction pipeline's own
        result.outputs["exp_show"] = project.run("dvc", "exp", "show", "--csv").stdout
        result.outputs["exp_show_prediction"] = project.run(
            "dvc", "exp", "show", "--csv", cwd=project.root / "prediction"
        ).stdout
    result.tree = tree.seen
    return result


def git_changes(project: Project) -> str:
    """The tracked files a command changed (`git status`, untracked files left out)."""
    return project.run("git", "status", "--porcelain", "--untracked-files=no").stdout


def test_the_quick_start_changes_no_tracked_file(ran):
    """scripts/demo.sh's two flows (training, then prediction) leave `git status` clean: the
    training flow changes nothing tracked, and the prediction flow adds nothing to what the
    test itself changed between them (its edit of enn_core/inference.py; `dvc repro` stages
    dvc.lock, core.autostage)."""
    assert ran.outputs["git_after_flow"] == "", ran.outputs["git_after_flow"]
    assert " M enn_core/inference.py\n" in ran.outputs["git_before_predict_flow"]
    assert ran.outputs["git_after_predict_flow"] == ran.outputs["git_before_predict_flow"]


ARTIFACT = """
import asyncio, json, sys
from uuid import UUID
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter
from prefect.client.schemas.filters import FlowRunFilterId, TaskRunFilter
async def main():
    async with get_client() as c:
        arts = await c.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[sys.argv[2]])),
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(sys.argv[1])])),
            task_run_filter=TaskRunFilter(), limit=10, offset=0, sort="KEY_ASC")
        print(json.dumps([a.data for a in arts]))
asyncio.run(main())
"""


def test_a_stages_prefect_artifact_links_its_mlflow_run(ran):
    """distributed-train's summary artifact in Prefect, read through Prefect's client (a
    temporary API over the project's PREFECT_HOME), links the stage's MLflow run page."""
    import sys

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{ran.project.root / 'work' / 'mlflow' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("enn").experiment_id
    flow = [
        r
        for r in client.search_runs([exp], "tags.`enn.kind` = 'pipeline'")
        if r.data.tags.get("enn.pipeline") == "training"
    ][0]
    flow_run_id = flow.data.tags["prefect.flow_run_id"]
    child = client.search_runs(
        [exp],
        f"tags.`mlflow.parentRunId` = '{flow.info.run_id}' and attributes.run_name = "
        "'distributed-train'",
    )[0]
    from tasks.env import FORCED  # telemetry off: the temporary API would phone home

    env = {k: v for k, v in ran.project.env.items() if k != "PREFECT_API_URL"} | FORCED
    for _ in range(3):  # the temporary API's SQLite can answer "database is locked" under load
        out = Project(ran.project.root, env).run(
            sys.executable,
            "-c",
            ARTIFACT,
            flow_run_id,
            "distributed-train-summary",
            timeout=180,
            check=False,
        )
        if out.returncode == 0:
            break
    assert out.returncode == 0, out.stderr[-3000:]
    (markdown,) = json.loads(out.stdout.strip().splitlines()[-1])
    run_id = child.info.run_id
    # no UI runs: the address `enn ui` serves it at by default (deploy.host, deploy.mlflow_port)
    page = f"http://127.0.0.1:5000/#/experiments/{exp}/runs/{run_id}?workflowType=machine_learning"
    link = f"[{run_id}]({page})"
    assert f"MLflow run: {link}" in markdown, markdown


def test_training_flow_ran_every_stage(ran):
    from enn_core.stages import TRAINING

    status = dict(re.findall(r"^(\S+)\s+(ran|skipped)\s", ran.outputs["flow"], re.M))
    assert status == {s.name: "ran" for s in TRAINING}, ran.outputs["flow"]
    root = ran.project.root
    for path in (
        "outputs/stage-data/manifest.json",
        "outputs/prepare-checkpoint/init.pt",
        "outputs/distributed-train/model.pt",
        "outputs/validate/metrics.json",
        "outputs/predict/predictions.npy",
        "outputs/predict/predictions.parquet",
        "outputs/collapse-check/report.json",
        "outputs/collapse-check/calibration.json",
        "outputs/export/model.onnx",
        "outputs/export/model.pt2",
        "outputs/export/sidecar.json",
        "outputs/export/parity.json",
        "outputs/metrics/validate.json",
        "outputs/metrics/distributed-train.json",
        "outputs/plots/distributed-train.json",
    ):
        assert (root / path).exists(), path
    train = json.loads((root / "outputs/distributed-train/record.json").read_text())
    assert train["world_size"] == 2 and sorted(train["rank_phases"]) == ["0", "1"], train
    # dvc metrics show: docs/metrics.md's names, the headline only; the rest in the stage's own
    metrics = json.loads((root / "outputs/distributed-train/metrics.json").read_text())
    assert metrics["train/world_size"] == 2 and metrics["train/restarts"] == 0, metrics
    dvc_metrics = json.loads((root / "outputs/metrics/distributed-train.json").read_text())
    assert list(dvc_metrics) == ["train/epochs_run"], dvc_metrics
    # quality on the synthetic data: better than the conditional naive predictor, not collapsed
    headline = json.loads((root / "outputs/metrics/validate.json").read_text())
    assert set(headline) == {"val/mae", "test/mae"}, headline
    val = json.loads((root / "outputs/validate/metrics.json").read_text())
    assert val["test/mae"] < val["test/naive_conditional_mae"], val
    report = json.loads((root / "outputs/collapse-check/report.json").read_text())
    assert report["status"] == "passed", report["why"]


def test_dvc_repro_after_the_flow_does_nothing_twice(ran):
    for key in ("repro1", "repro2", "status_after"):
        assert "Data and pipelines are up to date" in ran.outputs[key], ran.outputs[key]
    out = ran.project.run("dvc", "metrics", "show").stdout
    assert "val/mae" in out


def test_dvc_repro_runs_the_evaluation_stages_and_the_prediction_pipeline(ran):
    for stage in ("validate", "predict", "collapse_check", "export"):
        assert f"Running stage '{stage}'" in ran.outputs["repro3"], ran.outputs["repro3"]
    assert "Running stage 'stage_data'" not in ran.outputs["repro3"]
    for stage in ("predict", "collapse_check"):
        assert f"Running stage '{stage}'" in ran.outputs["predict_repro2"], ran.outputs[
            "predict_repro2"
        ]
    assert (ran.project.root / "outputs" / "export" / "model.onnx").exists()


def test_the_training_experiments_table_holds_the_training_pipeline_only(ran):
    """Issue 32: the prediction pipeline's params and deps (`prediction/params.yaml:data.path`,
    its input file) were columns of the training experiments' table; the prediction pipeline
    is its own DVC project (prediction/.dvc), with its own table."""
    training = ran.outputs["exp_show"].splitlines()[0].split(",")
    assert "val/mae" in training and any(c.endswith("train.lr") for c in training), training
    assert not [c for c in training if c.startswith(("prediction/", "../"))], training
    prediction = ran.outputs["exp_show_prediction"].splitlines()[0].split(",")
    assert any(c.endswith("predict.model") for c in prediction), prediction
    assert not any(c.endswith("train.lr") for c in prediction), prediction


def test_mlflow_records_runs_metrics_artifacts_and_models(ran):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{ran.project.root / 'work' / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp = client.get_experiment_by_name("enn")
    runs = client.search_runs([exp.experiment_id], max_results=500)
    parent = next(
        r
        for r in runs
        if r.data.tags.get("enn.pipeline") == "training"
        and r.data.tags.get("enn.kind") == "pipeline"
    )
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["prefect.flow_run_id"]
    children = {
        r.info.run_name: r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    assert len(children) == 7 and all(c.info.status == "FINISHED" for c in children.values())
    train = children["distributed-train"]
    val_loss = [k for k in train.data.metrics if "val" in k and "loss" in k]
    assert val_loss, sorted(train.data.metrics)
    assert len(client.get_metric_history(train.info.run_id, val_loss[0])) >= 2  # per epoch
    assert any(k.startswith("telemetry/bottleneck/") for k in train.data.metrics), (
        "telemetry: per-epoch verdict"
    )
    assert any(k.startswith("telemetry/memory/") for k in train.data.metrics), "memory"
    assert "diagnostics.json" in {a.path for a in client.list_artifacts(train.info.run_id)}
    arts = {a.path for a in client.list_artifacts(train.info.run_id)}
    assert "model.pt" in arts and "config.yaml" in arts
    assert any(a.path.endswith(".png") for a in client.list_artifacts(train.info.run_id, "plots"))
    assert train.data.tags.get("enn.world_size") == "2"
    params = train.data.params
    assert params.get("resolved.runtime.world_size") == "2"
    recorded = " ".join(k for k in params if k.startswith("resolved.runtime."))
    assert "precision" in recorded and ("attention" in recorded or "backend" in recorded), sorted(
        params
    )
    for stage, name in (
        ("stage-data", "manifest.json"),
        ("collapse-check", "report.json"),
        ("export", "sidecar.json"),
    ):
        assert name in {a.path for a in client.list_artifacts(children[stage].info.run_id)}, stage
    # export's run holds no second copy of the programs: they are in the registered bundle
    exported = {a.path for a in client.list_artifacts(children["export"].info.run_id)}
    assert not [p for p in exported if p.endswith((".pt2", ".onnx", ".data", "/"))], exported
    assert "export" not in exported, exported
    # stage-data's child run also shows its params: the data section and what it staged
    staged = children["stage-data"].data.params
    manifest = json.loads(
        (ran.project.root / "outputs" / "stage-data" / "manifest.json").read_text()
    )
    assert staged.get("data.source") == manifest["source"]["kind"], sorted(staged)
    assert staged.get("resolved.data.content_hash") == manifest["content_hash"], sorted(staged)
    version = client.get_model_version_by_alias("enn-synthetic", "champion")
    # dvc repro re-ran export (same model, same MAE): a new candidate, the champion stays
    candidate = client.get_model_version_by_alias("enn-synthetic", "candidate")
    assert int(candidate.version) > int(version.version)
    why = candidate.tags["enn.champion_decision"]  # the champion rule's, or the champion's
    assert "does not beat the champion" in why or "validation rows" in why, why
    for tag in ("enn.git_commit", "enn.data_fingerprint", "prefect.flow_run_id", "enn.world_size"):
        assert version.tags.get(tag), tag


def test_champion_loads_and_predicts_in_real_units(ran):
    import mlflow
    import mlflow.pyfunc

    from enn_core.data.dataset import StagedDataset
    from enn_core.serving import decode, typed

    root = ran.project.root
    uri = f"sqlite:///{root / 'work' / 'mlflow' / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    model = mlflow.pyfunc.load_model("models:/enn-synthetic@champion")
    ds = StagedDataset(root / "outputs" / "stage-data")
    rows = np.sort(np.asarray(ds.split("test")))
    # as the source spells them, in the signature's types (month "01" as the number 1)
    frame = typed(decode(np.asarray(ds.features[rows]), ds.feature_specs), ds.feature_specs)
    assert frame["month"].dtype == np.int64 and frame["daytype"].iloc[0].isalpha()
    out = model.predict(frame)
    target = np.asarray(ds.labels[rows])
    pred = out.to_numpy().reshape(target.shape)
    assert (
        np.abs(pred - target).mean() < np.abs(target - target.mean()).mean()
    )  # real units, skilful
    flow_pred = np.load(root / "prediction" / "outputs" / "predict" / "predictions.npy")
    assert flow_pred.ndim == 3 and np.isfinite(flow_pred).all()


def test_prediction_flow_and_pipeline(ran):
    assert "collapse-check" in ran.outputs["predict_flow"]
    root = ran.project.root
    assert (
        root / "prediction" / "model" / "SOURCE"
    ).read_text().strip() == "models:/enn-synthetic@champion"
    assert not (root / "prediction" / "work").exists(), "state must stay in the project's work/"
    report = json.loads(
        (ran.project.root / "prediction/outputs/collapse-check/report.json").read_text()
    )
    assert report
    # the flow recorded the downloaded champion (a local path DVC hashes): dvc repro agrees
    assert "Data and pipelines are up to date" in ran.outputs["predict_repro"], ran.outputs[
        "predict_repro"
    ]


def test_every_process_was_offline_and_watched(ran):
    violations = [json.loads(p.read_text()) for p in ran.guard_dir.glob("violation-*.json")]
    assert not violations, "non-loopback network use:\n" + "\n".join(
        f"{v['kind']} {v['target']} in {' '.join(v['argv'])[:120]}\n{''.join(v['stack'][-4:])}"
        for v in violations
    )
    watched = {
        int(p.stem.split("-")[1]): json.loads(p.read_text())
        for p in ran.guard_dir.glob("watched-*.json")
    }
    unwatched = []
    for pid, (name, cmd, ppid) in ran.tree.items():
        parent = ran.tree.get(ppid)
        if parent and parent[1] == cmd and ppid in watched:
            # a fork of a watched process, seen before it exec'd (a subprocess's child): it
            # holds the guard it inherited; what it exec'd into, if Python, leaves its own proof
            continue
        # a shell running a script (scripts/enn, which dvc.yaml's commands call) is named after
        # the script; the poll can catch it, or one of its `$(...)` subshells, before it execs
        shell = bool(cmd) and Path(cmd[0]).name in ("sh", "bash", "dash")
        is_python = not shell and (
            "python" in name
            or bool(cmd and "python" in Path(cmd[0]).name)
            or name in ("enn", "dvc", "prefect")
        )
        # multiprocessing's resource tracker (stdlib: it only reads a pipe of semaphore names,
        # never a socket) can be SIGKILLed with the worker group before its interpreter has
        # imported site, so it may leave no proof; it is the one helper excused
        if (
            is_python
            and pid not in watched
            and "multiprocessing.resource_tracker" not in " ".join(cmd)
        ):
            unwatched.append(f"{pid} {' '.join(cmd)[:150]}")
        elif not is_python and not shell and name not in NON_PYTHON_OK:
            unwatched.append(f"{pid} (not python: {name}) {' '.join(cmd)[:150]}")
    assert not unwatched, "child processes the guard did not watch:\n" + "\n".join(unwatched)
    cmds = [" ".join(w["argv"]) for w in watched.values()]
    assert any(c.split(" ")[0].endswith("enn") and " run" in c for c in cmds), "the flow process"
    assert any(
        "uvicorn" in c or "prefect" in c for c in cmds if not c.split(" ")[0].endswith("enn")
    ), "the Prefect server"
    # the one launcher's processes: torchrun's child and its workers' entry, both started as
    # `python -m <module> <run dir>/launch/job.json` (a watched process sees `-m` in its argv)
    assert any(c.endswith("/launch/job.json") for c in cmds), f"worker processes: {cmds}"
    assert any(c.split(" ")[0].endswith("dvc") for c in cmds), "dvc"


def test_warm_start_from_the_registered_champion(ran):
    """prepare-checkpoint with `checkpoint.init_from: champion` (this task's registered
    champion, `models:/enn-synthetic@champion`): the task layer downloads
    the version, prepare-checkpoint checks it fits and records where the weights came from."""
    import torch

    root = ran.project.root
    ran.project.run(
        "enn",
        "prepare-checkpoint",
        "--set",
        "checkpoint.init_from=champion",
        timeout=600,
    )
    info = json.loads((root / "outputs" / "prepare-checkpoint" / "init.json").read_text())
    assert info["warm_start"]["registry_uri"] == "models:/enn-synthetic@champion"
    init = torch.load(root / "outputs" / "prepare-checkpoint" / "init.pt", weights_only=True)[
        "state_dict"
    ]
    trained = torch.load(root / "outputs" / "distributed-train" / "model.pt", weights_only=True)[
        "state_dict"
    ]
    assert all(
        torch.equal(init[k], trained[k]) for k in trained
    )  # the champion is this run's model
