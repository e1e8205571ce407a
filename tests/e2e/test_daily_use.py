"""Daily use: retries of transient errors only, deployments on a schedule against a local
Prefect server, and the MLflow UI read through its REST API."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request

import psutil
import pytest

from tests.fixtures.project import clean_env, make_project

pytestmark = pytest.mark.timeout(1200)
TWO = ("stage-data", "prepare-checkpoint")


def http(url: str, body: dict | None = None) -> dict | list:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url,
        data=data,
        headers={"Content-Type": "application/json"},
        method="POST" if body is not None else "GET",
    )
    with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 - loopback
        return json.loads(r.read() or b"null")


@pytest.fixture
def two_stage(tmp_path, prefect_home_shared):
    return make_project(tmp_path / "proj", prefect_home_shared, stages=TWO)


def test_transient_fault_is_retried_and_bad_input_is_not(two_stage):
    ok = two_stage.run(
        "enn",
        "run",
        "--until",
        "stage-data",
        "--set",
        "fault.kind=transient",
        "--set",
        "fault.phase=stage-data",
        "--set",
        "fault.times=1",
    )
    text = ok.stdout + ok.stderr
    assert "injected transient fault" in text
    assert re.search(r"transient error .*: retry 1/2", text), text[-3000:]
    assert re.search(r"^stage-data\s+ran", ok.stdout, re.M)

    bad = two_stage.run(
        "enn",
        "run",
        "--until",
        "stage-data",
        "--set",
        "data.source=npy",
        "--set",
        "data.path=missing.npy",
        check=False,
    )
    assert bad.returncode == 3, bad.stderr[-2000:]
    assert "missing.npy" in bad.stderr
    assert "retry" not in bad.stdout + bad.stderr


def test_retried_training_task_resumes_from_its_checkpoint(tmp_path, prefect_home_shared):
    """A transient error mid-training: Prefect retries the task (a fresh rendezvous), and the
    retry resumes from the last committed checkpoint instead of starting over."""
    project = make_project(
        tmp_path / "proj", prefect_home_shared, stages=(*TWO, "distributed-train")
    )
    out = project.run(
        "enn",
        "run",
        "--until",
        "distributed-train",
        "--set",
        "train.epochs=2",
        "--set",
        "checkpoint.every_steps=2",
        "--set",
        "fault.kind=transient",
        "--set",
        "fault.phase=step",
        "--set",
        "fault.step=7",
    )
    text = out.stdout + out.stderr
    assert re.search(r"transient error .*: retry 1/2", text), text[-3000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(
        tracking_uri=f"sqlite:///{project.root / 'work' / 'mlflow' / 'mlflow.db'}"
    )
    exp = client.get_experiment_by_name("enn")
    train = client.search_runs([exp.experiment_id], "tags.`mlflow.runName` = 'distributed-train'")[
        0
    ]
    # 5 steps per epoch: saves at 2, 4, 5 (epoch end), 6; the fault before step 7
    assert train.data.params["resolved.checkpoint.resumed_from"].endswith("step-00000006")
    assert train.data.params["resolved.checkpoint.fingerprint"]
    assert train.data.metrics["telemetry/checkpoint/last_step"] == 10


def _start(project, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["enn", *args],
        cwd=project.root,
        env=project.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _read_until(proc: subprocess.Popen, pattern: str, timeout: float) -> re.Match:
    deadline = time.time() + timeout
    seen = []
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no {pattern!r} in output:\n{''.join(seen)[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


class Output:
    """Every line a process prints (the terminal of `enn deploy`, its flow runs' too), read by
    a thread as it comes."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._t.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> re.Match:
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = re.search(pattern, self.text(start), re.M)
            if m:
                return m
            time.sleep(0.5)
        raise AssertionError(f"no {pattern!r} in output:\n{self.text(start)[-4000:]}")

    def text(self, start: int = 0) -> str:
        return "".join(self.lines[start:])


def _finished(api: str, run_id: str, timeout: float) -> str:
    deadline, state = time.time() + timeout, None
    while time.time() < deadline:
        state = http(f"{api}/flow_runs/{run_id}")["state"]["type"]
        if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return state
        time.sleep(2)
    return str(state)


# third-party lines `enn run` keeps in its log file (flows/console.py NOISE, QUIET_WARNINGS)
NOISE = ("signal handlers", "torchvision", "FutureWarning", "[torch.onnx]", "contain() called")


def _daily_cron_away_from_now() -> str:
    """A daily cron 12 hours from now: the server schedules its runs (the test sees them) and
    none falls due while the test runs (CI's clock is anywhere)."""
    at = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=12)
    return f"{at.minute} {at.hour} * * *"


def test_deploy_serves_its_schedules_and_its_runs_talk_like_enn_run(project, tmp_path):
    cron = _daily_cron_away_from_now()
    project.set_params([f"deploy.cron={cron}"])
    proc = _start(project, "deploy")
    out = Output(proc)
    try:
        api = out.wait_for(r"Prefect server: (http://127\.0\.0\.1:\d+/api)", 240).group(1)
        # what it serves and when, and how to trigger a run
        out.wait_for(rf"^  training/scheduled +cron '{re.escape(cron)}' \(UTC\): next 20\d\d-", 60)
        out.wait_for(r"^  prediction/on-demand +on demand$", 10)
        trigger = out.wait_for(r"^trigger a run: (.*)$", 10).group(1)
        deadline = time.time() + 180
        deployments = []
        while time.time() < deadline and len(deployments) < 3:
            deployments = http(f"{api}/deployments/filter", {})
            time.sleep(1)
        by_name = {d["name"]: d for d in deployments}
        assert set(by_name) == {"scheduled", "on-demand"}  # prediction and tuning: on demand
        assert len(deployments) == 3
        # every link the console prints answers a browser (which asks for HTML: the UI's pages
        # are client-side routes, served as its index page only then) with the UI, not a 404
        link = out.wait_for(r"^Prefect UI: (http://\S+)$", 10).group(1)
        assert link == f"{api.removesuffix('/api')}/deployments", link
        browser = urllib.request.Request(link, headers={"Accept": "text/html"})
        with urllib.request.urlopen(browser, timeout=30) as r:
            assert r.status == 200 and b"<html" in r.read().lower(), link
        train_id = by_name["scheduled"]["id"]
        scheduled = []
        while time.time() < deadline and not scheduled:  # the server's scheduler, not a tick
            scheduled = http(
                f"{api}/flow_runs/filter",
                {
                    "deployments": {"id": {"any_": [train_id]}},
                    "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}},
                },
            )
            time.sleep(1)
        assert scheduled, "the scheduler created no scheduled run"

        # two training runs due at once (a trigger while the cron's run trains): the second
        # waits for the first (one run at a time: both take the work directory's lock) instead
        # of failing on the lock; the first trains with the console enn run has (epoch lines,
        # no noise), the second has nothing to do, says so and adds no MLflow parent run
        mark = len(out.lines)
        soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=2)
        run = http(
            f"{api}/deployments/{train_id}/create_flow_run", {"state": {"type": "SCHEDULED"}}
        )
        again = http(
            f"{api}/deployments/{train_id}/create_flow_run",
            {"state": {"type": "SCHEDULED", "state_details": {"scheduled_time": soon.isoformat()}}},
        )
        state = _finished(api, run["id"], 900)
        trained = out.text(mark)
        assert state == "COMPLETED", trained[-6000:]
        assert re.search(r"^\d\d:\d\d:\d\d distributed-train: epoch \d+/20 ", trained, re.M)
        assert not [n for n in NOISE if n in trained], trained[-4000:]
        assert "Beginning flow run" not in trained  # Prefect's INFO: its UI's log, not here
        assert "Traceback" not in trained, trained[-4000:]
        assert "another pipeline run holds" not in trained, trained[-4000:]
        assert _finished(api, again["id"], 600) == "COMPLETED", out.text(mark)[-4000:]
        out.wait_for(r"training: every stage is up to date .* no MLflow run is recorded", 60, mark)

        # the printed trigger, from a shell that has no Prefect setting, with a parameter: a
        # prediction run (the champion is there) whose input is missing: one line, no
        # traceback, no "contain() called after importing ['mlflow']" warning
        mark = len(out.lines)
        bad = 'overrides=["data.source=csv", "data.path=missing.csv"]'
        shell = subprocess.run(
            ["bash", "-c", f"{trigger} --param '{bad}'"],
            env=clean_env(HOME=str(tmp_path)),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert shell.returncode == 0 and "Created flow run" in shell.stdout, shell
        run_id = re.search(r"UUID: ([0-9a-f-]{36})", shell.stdout).group(1)
        assert _finished(api, run_id, 600) == "FAILED"
        line = out.wait_for(
            r"^\d\d:\d\d:\d\d ERROR: data\.path='missing\.csv': .*$", 60, mark
        ).group(0)
        failed = out.text(mark)
        assert failed.count("ERROR") == 1 and "Traceback" not in failed, failed[-3000:]
        assert not [n for n in NOISE if n in failed], failed[-3000:]
        assert "put it there or fix data.path" in line, line
    finally:
        _stop(proc)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(
        tracking_uri=f"sqlite:///{project.root / 'work' / 'mlflow' / 'mlflow.db'}"
    )
    exp = client.get_experiment_by_name("enn")
    parents = client.search_runs([exp.experiment_id], "tags.`enn.kind` = 'pipeline'")
    by_flow_run = {p.data.tags.get("prefect.flow_run_id"): p for p in parents}
    assert by_flow_run[run["id"]].info.status == "FINISHED"
    assert again["id"] not in by_flow_run  # no "training #2" with copies of the last results
    leftovers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if api.split(":")[2].split("/")[0] in " ".join(p.info["cmdline"] or [])
    ]
    assert not leftovers, "the Prefect server outlived enn deploy"


def test_enn_ui_serves_mlflow_and_prefect_and_a_run_reports_to_it(two_stage):
    """`enn ui`: the MLflow UI and the Prefect UI over the project's stores, on loopback; an
    `enn run` meanwhile reports to its Prefect server (no second server on the database),
    under a name that says what it does."""
    two_stage.run("enn", "stage-data")
    proc = _start(two_stage, "ui", "--port", "0")
    try:
        url = _read_until(proc, r"MLflow UI: (http://127\.0\.0\.1:\d+)", 240).group(1)
        prefect = _read_until(proc, r"Prefect UI: (http://127\.0\.0\.1:\d+) ", 240).group(1)
        exps = http(f"{url}/api/2.0/mlflow/experiments/search", {"max_results": 10})["experiments"]
        exp = next(e for e in exps if e["name"] == "enn")
        found = http(
            f"{url}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp["experiment_id"]]}
        )["runs"]
        assert "stage-data" in {r["info"]["run_name"] for r in found}
        with urllib.request.urlopen(prefect, timeout=30) as r:  # the UI's page
            assert r.status == 200 and b"<html" in r.read().lower()
        out = two_stage.run("enn", "run", "--until", "stage-data", "--set", "data.split_seed=4")
        assert f"Prefect API: {prefect}/api (enn ui's" in out.stderr, out.stderr[-2000:]
        name = "training params.yaml data.split_seed=4 until stage-data"
        # the Prefect home is shared with other tests: ask for this run by its name
        query = {"flow_runs": {"name": {"any_": [name]}}, "limit": 10}
        runs = http(f"{prefect}/api/flow_runs/filter", query)
        assert [r["name"] for r in runs] == [name], runs
        # the closing summary links this run's own pages in both UIs, and they answer
        mlflow_link = re.search(r"^look: MLflow run (http://\S+)$", out.stdout, re.M)
        prefect_link = re.search(r"^look: Prefect flow run (http://\S+)$", out.stdout, re.M)
        assert mlflow_link and prefect_link, out.stdout
        assert prefect_link.group(1) == f"{prefect}/runs/flow-run/{runs[0]['id']}"
        page = re.fullmatch(
            rf"{url}/#/experiments/(\d+)/runs/(\w+)\?workflowType=machine_learning",
            mlflow_link.group(1),
        )
        assert page and page.group(1) == exp["experiment_id"], mlflow_link.group(1)
        run = http(f"{url}/api/2.0/mlflow/runs/get?run_id={page.group(2)}")["run"]
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert tags["prefect.flow_run_id"] == runs[0]["id"], tags  # this run's parent run
        for link in (mlflow_link.group(1), prefect_link.group(1)):
            browser = urllib.request.Request(link, headers={"Accept": "text/html"})
            with urllib.request.urlopen(browser, timeout=30) as r:
                assert r.status == 200 and b"<html" in r.read().lower(), link
        listening = {
            c.laddr.ip
            for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            for c in p.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN
        }
        assert listening == {"127.0.0.1"}, listening
    finally:
        _stop(proc)
    assert not (two_stage.root / "work" / "ui.json").exists()
