"""MLflow lifecycle: parent and child runs, failures, killed runs, dvc repro grouping, lineage."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from mlflow.tracking import MlflowClient

from tests.fixtures.project import make_project

pytestmark = pytest.mark.timeout(900)
TWO = ("stage-data", "prepare-checkpoint")


def client_for(project) -> MlflowClient:
    uri = f"sqlite:///{project.root / 'work' / 'mlflow' / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def runs(project, filter_string: str = ""):
    c = client_for(project)
    exp = c.get_experiment_by_name("enn")
    return c.search_runs([exp.experiment_id], filter_string, max_results=200) if exp else []


@pytest.fixture
def two_stage(tmp_path, prefect_home_shared):
    return make_project(tmp_path / "proj", prefect_home_shared, stages=TWO)


def test_failed_stage_marks_child_and_parent_failed(two_stage):
    out = two_stage.run(
        "enn",
        "run",
        "--until",
        "prepare-checkpoint",
        "--set",
        "fault.kind=raise",
        "--set",
        "fault.phase=prepare-checkpoint",
        check=False,
    )
    assert out.returncode != 0
    by_name = {r.info.run_name: r for r in runs(two_stage)}
    assert by_name["prepare-checkpoint"].info.status == "FAILED"
    assert "injected fault" in by_name["prepare-checkpoint"].data.tags["enn.error"]
    parent = next(r for r in runs(two_stage) if r.data.tags.get("enn.kind") == "pipeline")
    assert parent.info.status == "FAILED"
    assert "prepare-checkpoint" in parent.data.tags["enn.error"]


def test_killed_run_is_marked_killed_next_time(two_stage):
    p = two_stage
    log = open(p.root / "hang.log", "w")
    proc = subprocess.Popen(
        ["enn", "stage-data", "--set", "fault.kind=hang", "--set", "fault.phase=stage-data"],
        cwd=p.root,
        env=p.env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # Wait for the hang fault to fire (after the stage's MLflow run exists) before touching
        # the store: opening it while the child creates its tables races their migration.
        marker = p.root / "work" / "faults" / "fault-hang-stage-data-0"
        deadline = time.time() + 300
        while time.time() < deadline and not marker.exists():
            time.sleep(0.5)
        assert marker.exists(), (
            "the hang never fired:\n" + (p.root / "hang.log").read_text()[-3000:]
        )
        assert any(
            r.info.run_name == "stage-data" for r in runs(p, "attributes.status = 'RUNNING'")
        )
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    p.run("enn", "stage-data")
    statuses = sorted(
        r.info.status
        for r in runs(p)
        if r.info.run_name == "stage-data" and r.data.tags.get("enn.kind") == "stage"
    )
    assert statuses == ["FINISHED", "KILLED"]
