"""MLflow as its users meet it, over a sequence of trainings in one store.

Four `enn run`s of one project: a short training (the first champion); a lower learning rate
(worse: registered, not promoted); one so short that collapse-check fails (nothing registered,
the parent run says why); then refreshed data with more rows trained longer (another data
fingerprint: the champion is scored on the new version's validation rows, and loses), run as
`--flow both` (the prediction flow follows in the same process, with the new champion). Then
the prediction flow without `--model`, the registered model through `mlflow.pyfunc`, `mlflow
models serve` over HTTP, `mlflow models predict` on a CSV, and MLflow's REST API through
`mlflow server`. Every metric and decided parameter logged, and every DVC metrics file, is
checked against docs/metrics.md.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fixtures.project import Project, copy_project

pytestmark = pytest.mark.timeout(1200)  # four trainings, one of 16 replicates (the champion rule)
NAME = "enn-synthetic"  # the demo data's registered model (tracking.registered_model empty)


@dataclass
class Store:
    project: Project
    uri: str
    outputs: list[str]
    consoles: list[tuple[str, str]]  # (stdout, stderr) of each run
    predicted_with_third: bool  # the last run's prediction flow used version 3's model.pt


@pytest.fixture(scope="module")
def store(tmp_path_factory, trained_project) -> Store:
    """The session's trained project (its `enn run --set train.epochs=12`: the first
    champion), copied, then three more trainings in the same store."""
    project = copy_project(trained_project.project, tmp_path_factory.mktemp("models") / "proj")
    runs = [  # (overrides, exit code, flow)
        (["train.lr=0.005"], 0, "training"),
        (["train.lr=0.01", "train.epochs=4"], 6, "training"),  # collapse-check fails
        # refreshed data with enough validation rows for the champion rule (at least 30), a
        # model that wins: no fitted baselines configured, the naive predictors to beat; then
        # the prediction flow in the same process (scripts/demo.sh's `--flow both`)
        (["data.synthetic.n_replicates=16", "train.epochs=25", "validate.baselines=[]"], 0, "both"),
    ]
    outputs = [trained_project.stdout + trained_project.stderr]
    consoles = [(trained_project.stdout, trained_project.stderr)]
    for overrides, code, flow in runs:
        args = [a for o in overrides for a in ("--set", o)]
        out = project.run("enn", "run", "--flow", flow, *args, check=False, timeout=600)
        assert out.returncode == code, out.stdout[-2000:] + out.stderr[-3000:]
        outputs.append(out.stdout + out.stderr)
        consoles.append((out.stdout, out.stderr))
    uri = f"sqlite:///{project.root / 'work' / 'mlflow' / 'mlflow.db'}"
    from tasks.tracking.models import stored_model_dir

    # what the prediction half of `--flow both` predicted with, before another test fetches
    linked = project.root / "prediction" / "model" / "model.pt"
    third = stored_model_dir(f"models:/{NAME}/3", uri)
    predicted_with_third = third is not None and linked.samefile(third / "model.pt")
    return Store(project, uri, outputs, consoles, predicted_with_third)


def client(store: Store):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=store.uri, registry_uri=store.uri)


def test_the_champion_moves_with_the_reasons_in_the_tags(store):
    assert "version 1: champion" in store.outputs[0], store.outputs[0][-800:]
    assert "every candidate collapsed" in store.outputs[2] and "version 3" not in store.outputs[2]
    assert "version 3: champion" in store.outputs[3], store.outputs[3][-800:]
    c = client(store)
    found = c.search_model_versions(f"name='{NAME}'")
    versions = {int(v.version): c.get_model_version(NAME, v.version) for v in found}
    assert sorted(versions) == [1, 2, 3]
    second, third = versions[2].tags, versions[3].tags
    # 6 validation rows are too few for the rule: neither version passes it, so the second is
    # champion when it beats the first on them (issue 54: one rule), and the console's line
    # says why (`enn export` alone prints no summary)
    assert versions[1].tags["enn.passes_rule"] == second["enn.passes_rule"] == "no"
    (line,) = [x for x in store.outputs[1].splitlines() if f"export: {NAME} version 2: " in x]
    assert line.endswith(second["enn.champion_decision"]) and "validation rows" in line, line
    promoted = float(second["enn.val_mae"]) < float(second["enn.champion_val_mae_on_these_rows"])
    role = "champion: " if promoted else "candidate (champion unchanged): "
    assert f"version 2: {role}" in line, line
    before = 2 if promoted else 1  # the champion version 3 had to beat
    # refreshed data: another fingerprint, the champion scored on this version's rows
    assert third["enn.data_fingerprint"] != versions[1].tags["enn.data_fingerprint"]
    assert third["enn.schema"] == versions[1].tags["enn.schema"]
    why = third["enn.champion_decision"]
    assert f"beats the champion's (version {before})" in why and "validation rows" in why, why
    assert third["enn.passes_rule"] == "yes" and "passes the rule" in why, why
    champion_here = float(third["enn.champion_val_mae_on_these_rows"])
    assert champion_here != float(versions[before].tags["enn.val_mae"])
    assert str(c.get_model_version_by_alias(NAME, "champion").version) == "3"
    for v in versions.values():
        assert float(v.tags["enn.val_mae"]) < float(v.tags["enn.naive_val_mae"])


def test_flow_both_predicts_with_the_champion_it_just_promoted(store):
    """The last run is `enn run --flow both`: training promotes version 3, then the prediction
    flow, in the same process and on the same Prefect API, fetches the champion alias anew and
    predicts with version 3 (not the champion the process may have read before)."""
    stdout, stderr = store.consoles[3]  # the summaries; the timed lines
    promoted = stderr.index("export: enn-synthetic version 3: champion")
    assert promoted < stderr.index(f"model models:/{NAME}@champion -> "), stderr[-3000:]
    assert stderr.count("Prefect API: ") == 1, stderr[-3000:]
    # each flow's own summary: training's results, then prediction's predictions file
    assert stdout.index("results: val MAE") < stdout.index("predictions: "), stdout
    # the second flow in the process says only the project's lines too (no warning of a
    # setting read twice, no third-party line)
    strange = [
        line
        for line in stderr.splitlines()
        if not OWN.match(line) and not re.match(rf"^\d\d:\d\d:\d\d model models:/{NAME}@", line)
    ]
    strange += [
        line
        for line in stdout.splitlines()
        if not SUMMARY.match(line) and not line.startswith("predictions: ")
    ]
    assert not strange, "lines a user would wonder about:\n" + "\n".join(strange[:20])
    assert store.predicted_with_third
    import mlflow

    mlflow.set_tracking_uri(store.uri)
    exp = mlflow.get_experiment_by_name("enn")
    last = mlflow.search_runs(
        [exp.experiment_id],
        filter_string="tags.`enn.kind` = 'pipeline'",
        order_by=["attributes.start_time DESC"],
        max_results=2,
    )
    # two parent runs, one per flow, both finished
    assert last["tags.enn.flow"].tolist() == ["prediction", "training"], last
    assert last["status"].tolist() == ["FINISHED", "FINISHED"]


def test_parents_line_up_parameters_with_results(store):
    import mlflow

    mlflow.set_tracking_uri(store.uri)
    exp = mlflow.get_experiment_by_name("enn")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    parents = mlflow.search_runs(
        [exp.experiment_id],
        filter_string="tags.`enn.kind` = 'pipeline' and tags.`enn.flow` = 'training'",
        order_by=["attributes.start_time ASC"],
    )
    assert parents["status"].tolist() == ["FINISHED", "FINISHED", "FAILED", "FINISHED"]
    assert parents["params.train.lr"].tolist() == ["0.01", "0.005", "0.01", "0.01"]
    assert parents["metrics.val/mae"].notna().all() and parents["metrics.test/mae"].notna().all()
    done = parents[parents["status"] == "FINISHED"]
    assert (done["metrics.val/skill_vs_naive_conditional"] > 0).all()
    # the second is champion when it beats the first on their 6 validation rows (neither
    # passes the champion rule there: issue 54's one rule)
    second = client(store).get_model_version(NAME, "2").tags
    beat = float(second["enn.val_mae"]) < float(second["enn.champion_val_mae_on_these_rows"])
    assert done["metrics.registry/promoted"].tolist() == [1.0, float(beat), 1.0]
    assert "CollapseError" in parents["tags.enn.error"].iloc[2]
    names = parents["tags.mlflow.runName"].tolist()
    assert names[0] == "training #1 synthetic train.epochs=12" and len(set(names)) == 4, names
    assert names[1] == "training #2 synthetic train.lr=0.005", names  # not a diff with run 1
    assert "data.synthetic.n_replicates=16" in names[3], names
    assert (parents["tags.mlflow.source.name"] == "flows/training.py").all()
    c = client(store)
    runs = [c.get_run(r) for r in parents["run_id"]]
    digests = [r.inputs.dataset_inputs[0].dataset.digest for r in runs]
    assert digests[0] == digests[1] == digests[2] != digests[3]
    models = [r.outputs.model_outputs if r.outputs else [] for r in runs]  # the Models column
    assert [len(m) for m in models] == [1, 1, 0, 1]
    params = runs[0].data.params
    assert params["data.synthetic.n_months"] == "4" and params["model.d_model"] == "16"


def test_every_logged_name_is_in_the_table(store):
    from tests.unit.test_metric_names import undocumented

    c = client(store)
    exp = c.get_experiment_by_name("enn")
    names: set[str] = set()
    for run in c.search_runs([exp.experiment_id], max_results=500):
        names |= set(run.data.metrics)
        names |= {k for k in run.data.params if k.startswith("resolved.")}
    for path in (store.project.root / "outputs" / "metrics").glob("*.json"):
        names |= set(json.loads(path.read_text()))
    assert "epoch/val_loss" in names and "telemetry/bottleneck/code" in names
    assert not undocumented(names)


def test_prediction_flow_uses_the_champion_and_any_client_calls_it(store, tmp_path):
    import mlflow.pyfunc
    import pandas as pd

    root = store.project.root
    store.project.run("enn", "run", "--flow", "prediction", timeout=600)
    assert (root / "prediction/model/SOURCE").read_text().strip() == f"models:/{NAME}@champion"
    # the store is on this machine: the local copy is the store's file, linked, not copied
    from tasks.tracking.models import stored_model_dir

    stored = stored_model_dir(f"models:/{NAME}@champion", store.uri)
    assert stored is not None and (root / "prediction/model/model.pt").samefile(stored / "model.pt")
    mlflow.set_tracking_uri(store.uri)
    model = mlflow.pyfunc.load_model(f"models:/{NAME}@champion")
    # the signature's types: month, a category spelled "01", as the whole number it is
    inputs = {c.name: str(c.type) for c in model.metadata.get_input_schema().inputs}
    assert inputs["month"] == "DataType.long" and inputs["daytype"] == "DataType.string"
    frame = pd.DataFrame({"month": [1, 4], "daytype": ["sun", "mon"], "direction": ["up", "down"]})
    out = model.predict(frame)
    assert out.shape[0] == 2 and all("|" in c for c in out.columns)
    # mlflow models predict on a CSV spelled as the source spells it (month 01)
    csv = tmp_path / "new.csv"
    csv.write_text("month,daytype,direction\n01,sun,up\n04,mon,down\n")
    Project(root, {**store.project.env, "MLFLOW_TRACKING_URI": store.uri}).run(
        "mlflow",
        "models",
        "predict",
        "-m",
        f"models:/{NAME}@champion",
        "-i",
        str(csv),
        "-t",
        "csv",
        "--env-manager",
        "local",
        "-o",
        str(tmp_path / "out.json"),
        timeout=300,
    )
    got = json.loads((tmp_path / "out.json").read_text())["predictions"]
    assert len(got) == 2 and abs(got[0][out.columns[0]] - out.iloc[0, 0]) < 1e-3


def test_prediction_with_a_model_of_another_task_is_one_line_and_exit_3(trained_project, tmp_path):
    """`--model` a checkpoint of the same features but another label grid (3 sections, not 4):
    refused before predicting, exit 3 (DataError), one line, no traceback."""
    from enn_core.checkpoint import save_consolidated
    from enn_core.config.model import ModelConfig
    from enn_core.data.dataset import StagedDataset
    from enn_core.model import build_model
    from enn_core.stages.demo import stage_synthetic
    from tests.fixtures.project import TINY

    synthetic = {**TINY["data"]["synthetic"], "n_sections": 3}
    data_dir = stage_synthetic(tmp_path / "other", **synthetic)
    ds = StagedDataset(data_dir)
    cfg = ModelConfig(preset="tabular", d_model=16, layers=1, embed_dim=4)
    other = tmp_path / "other" / "model.pt"
    save_consolidated(
        other,
        build_model(cfg, ds.manifest.model_data(), data_dir=data_dir),
        cfg,
        ds.manifest.model_data(),
        {"precision": "fp32"},
    )
    project = copy_project(trained_project.project, tmp_path / "proj")
    out = project.run("enn", "run", "--flow", "prediction", "--model", str(other), check=False)
    said = out.stdout + out.stderr
    assert out.returncode == 3, said[-3000:]
    line = "the model predicts labels of shape [3, 6] but this task's are [4, 6]"
    hits = [x for x in said.splitlines() if line in x]
    assert len(hits) == 1 and "it is a model of another task" in hits[0], said[-3000:]
    assert "Traceback" not in said


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_up(url: str, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else proc.returncode
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} did not answer in {seconds} s")


def test_enn_serve_answers_json_and_csv_as_it_prints_them(store, tmp_path):
    """Issue 32: the `mlflow models serve` line (now docs/serving.md's), run from the project
    root, answered "Registered Model ... not found" (no tracking URI) and a CSV body always
    failed (month was typed Any). `enn serve` serves the champion over the project's store; the
    JSON and the CSV requests it prints work as printed."""
    proc = subprocess.Popen(
        ["enn", "serve", "--port", "0"],
        cwd=store.project.root,
        env=store.project.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    said: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not any("  CSV:  " in x for x in said):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(said)
            said.append(line)
        text = "".join(said)
        url = re.search(rf"serving models:/{NAME}@champion at (http://127\.0\.0\.1:\d+)", text)
        assert url, text
        requests = {
            kind: re.search(rf"^  {kind}: +(.*)$", text, re.M).group(1) for kind in ("JSON", "CSV")
        }
        for kind, command in requests.items():
            done = subprocess.run(
                ["bash", "-c", command], capture_output=True, text=True, timeout=60
            )
            body = json.loads(done.stdout)
            assert len(body["predictions"]) == 1, (kind, done.stdout[:500])
            assert all(isinstance(v, float) for v in body["predictions"][0].values()), kind
        # a CSV of the source's spellings, and an unseen category: one line, HTTP 400
        invocations = f"{url.group(1)}/invocations"
        csv = b"month,daytype,direction\n01,sun,up\n04,mon,down\n"
        req = urllib.request.Request(invocations, csv, {"Content-Type": "text/csv"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert len(json.loads(r.read())["predictions"]) == 2
        columns = ["month", "daytype", "direction"]
        status, body = post(
            invocations,
            {"dataframe_split": {"columns": columns, "data": [["01", "someday", "up"]]}},
        )
        assert status == 400, body
        line = "column 'daytype': value 'someday' is not in the training vocabulary"
        assert line in body["message"] and "Traceback" not in body["message"], body
        assert not (store.project.root / "mlflow.db").exists()  # no stray store
    finally:
        import os
        import signal

        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)


def test_the_rest_api_shows_parents_models_and_the_champion(store, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    artifacts = (store.project.root / "work" / "mlflow" / "artifacts").as_uri()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [
            "mlflow",
            "server",
            "--backend-store-uri",
            store.uri,
            "--default-artifact-root",
            artifacts,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        cwd=store.project.root,
        env=store.project.env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_up(f"{url}/health", proc)
        exp = json.loads(
            urllib.request.urlopen(
                f"{url}/api/2.0/mlflow/experiments/get-by-name?experiment_name=enn"
            ).read()
        )["experiment"]
        status, found = post(
            f"{url}/api/2.0/mlflow/runs/search",
            {
                "experiment_ids": [exp["experiment_id"]],
                "filter": "tags.`enn.kind` = 'pipeline' and tags.`enn.flow` = 'training'",
            },
        )
        assert status == 200 and len(found["runs"]) == 4
        for run in found["runs"]:
            keys = {m["key"] for m in run["data"]["metrics"]}
            params = {p["key"]: p["value"] for p in run["data"]["params"]}
            assert {"val/mae", "test/mae", "val/r2"} <= keys and "train.lr" in params
            assert run["inputs"]["dataset_inputs"][0]["dataset"]["name"] == "synthetic"
        alias = json.loads(
            urllib.request.urlopen(
                f"{url}/api/2.0/mlflow/registered-models/alias?name={NAME}&alias=champion"
            ).read()
        )
        version = alias["model_version"]
        assert version["version"] == "3" and version["source"].startswith("models:/m-"), version
        status, models = post(
            f"{url}/api/2.0/mlflow/logged-models/search", {"experiment_ids": [exp["experiment_id"]]}
        )
        assert status == 200 and len(models["models"]) == 3, models
        # the source run is the pipeline's parent: MLflow's run list shows the model in the
        # parent's Models column (it groups logged models by source run)
        parents = {run["info"]["run_id"] for run in found["runs"]}
        assert all(m["info"]["source_run_id"] in parents for m in models["models"]), models
        ids = {m["info"]["model_id"] for m in models["models"]}
        assert version["source"].removeprefix("models:/") in ids
    finally:
        import os
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


# The project's own console lines (flows/console.py): a timestamp and a stage, the flow or the
# run's closing summary. Anything else (a third-party INFO or warning line) fails the test.
OWN = re.compile(
    r"^\d\d:\d\d:\d\d (Prefect API: |params: |WARNING: |(stage-data|prepare-checkpoint|"
    r"distributed-train|validate|predict|collapse-check|export)[: ])"
)
SUMMARY = re.compile(
    r"^((stage-data|prepare-checkpoint|distributed-train|validate|predict|collapse-check|"
    r"export) +(ran|skipped) |results: |model: |outputs: |log: |look: |params: |  \S)"
)  # "  ...": the `model:` line's reason, wrapped at 120 columns


def test_the_console_holds_only_the_projects_lines(store):
    """The first training (all seven stages, 12 epochs): every line is the project's own; at
    most a few per stage, plus one per epoch."""
    stdout, stderr = store.consoles[0]
    strange = [line for line in stderr.splitlines() if not OWN.match(line)]
    strange += [line for line in stdout.splitlines() if not SUMMARY.match(line)]
    assert not strange, "lines a user would wonder about:\n" + "\n".join(strange[:20])
    epochs = [line for line in stderr.splitlines() if re.search(r"epoch \d+/12 ", line)]
    assert len(epochs) == 12, stderr
    # a few per stage: validate says the most (two baselines, a warning, two MAE lines, the
    # skill, its time), predict two lines and its time, export its progress, the version and,
    # for a first version made champion without passing the rule, why
    assert len(stderr.splitlines()) <= 4 * 7 + 2 + len(epochs), stderr
    assert "results: val MAE" in stdout and "model: enn-synthetic version 1: champion" in stdout
    log = re.search(r"^log: (\S+)", stdout, re.M)
    assert log and "Finished in state Completed()" in Path(log.group(1)).read_text()


def test_dvc_metrics_show_fits_a_terminal(store):
    wide = Project(store.project.root, {**store.project.env, "COLUMNS": "120"})
    out = wide.run("dvc", "metrics", "show")
    widths = [len(line) for line in out.stdout.splitlines()]
    assert widths and max(widths) <= 120, out.stdout
    assert "val/mae" in out.stdout and "train/epochs_run" in out.stdout
