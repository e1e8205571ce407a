"""The pipeline's MLflow parent run shows what this run made: a run that fails before its
stage-data finished is not logged with the previous run's input dataset (issue 32)."""

from __future__ import annotations

import pytest

from enn_core.config import load_config
from enn_core.errors import DataError
from enn_core.paths import Layout
from enn_core.stages import STAGE_DATA
from tests.fixtures.project import tiny_overrides


def test_a_failed_run_is_not_logged_with_the_previous_runs_dataset(tmp_path):
    from mlflow.tracking import MlflowClient

    from tasks.runner import execute_stage
    from tasks.session import pipeline_session

    (tmp_path / "params.yaml").write_text("{}\n")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(None, [*tiny_overrides(), f"tracking.uri={uri}"])
    layout = Layout.for_root(tmp_path)
    config = tmp_path / "params.yaml"
    specs = (STAGE_DATA,)
    with pipeline_session(cfg, config, layout, "prediction", specs=specs) as first:
        execute_stage(STAGE_DATA, first)
    with (
        pytest.raises(DataError),
        pipeline_session(cfg, config, layout, "prediction", specs=specs) as second,
    ):
        raise DataError("new.csv: row 2: category 'someday' was not seen in training")
    client = MlflowClient(tracking_uri=uri)
    ok, failed = client.get_run(first.parent_id), client.get_run(second.parent_id)
    assert ok.info.status == "FINISHED" and failed.info.status == "FAILED"
    assert [d.dataset.name for d in ok.inputs.dataset_inputs] == ["synthetic"]
    assert failed.inputs.dataset_inputs == [], "the failed run shows the previous run's input"


def test_every_run_of_a_slurm_job_carries_its_job_id(tmp_path, monkeypatch):
    """Under SLURM the parent and each stage's run carry `enn.slurm.job_id` (and the array's ids):
    MLflow's search for the tag lists one job's runs, every node's and attempt's, together;
    a value that is not SLURM's (not a number) is left out."""
    from mlflow.tracking import MlflowClient

    from tasks.runner import execute_stage
    from tasks.session import pipeline_session

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4240")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1; rm -rf /")
    (tmp_path / "params.yaml").write_text("{}\n")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(None, [*tiny_overrides(), f"tracking.uri={uri}"])
    layout = Layout.for_root(tmp_path)
    with pipeline_session(cfg, tmp_path / "params.yaml", layout, "training") as session:
        execute_stage(STAGE_DATA, session)
    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(session.parent_id)
    found = client.search_runs([parent.info.experiment_id], "tags.`enn.slurm.job_id` = '4242'")
    assert {r.info.run_id for r in found} == {
        parent.info.run_id,
        *(r.info.run_id for r in found if r.data.tags.get("mlflow.parentRunId")),
    }
    assert len(found) == 2, [r.data.tags.get("mlflow.runName") for r in found]  # parent, stage
    for run in found:
        assert run.data.tags["enn.slurm.array_job_id"] == "4240"
        assert "enn.slurm.restart_count" not in run.data.tags


def test_the_commands_of_one_slurm_job_share_one_parent_run(tmp_path, monkeypatch):
    """Every `enn` of a SLURM job (each node's task, each later step, a requeued run) records
    under one parent run: the job's first task makes it, a later task waits for it rather than
    making a second when both start at once, and another job gets its own."""
    import threading
    import time

    from mlflow.tracking import MlflowClient

    from tasks import session as sessions
    from tasks.runner import execute_stage
    from tasks.session import job_group, pipeline_session, slurm_group

    (tmp_path / "params.yaml").write_text("{}\n")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(None, [*tiny_overrides(), f"tracking.uri={uri}"])
    layout = Layout.for_root(tmp_path)
    config = tmp_path / "params.yaml"
    monkeypatch.delenv("DVC_STAGE", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_PROCID", "1")  # node2's task: waits for task 0's parent
    second = slurm_group()
    assert second is not None and not second.makes and second.key == "slurm-77"
    monkeypatch.setenv("SLURM_PROCID", "0")
    first = job_group()
    assert first is not None and first.makes and not first.run_dirs
    made: list[str | None] = []

    def task(group):
        with pipeline_session(cfg, config, layout, "training", group=group) as s:
            made.append(s.parent_id)

    joiner = threading.Thread(target=task, args=(second,))
    joiner.start()  # it starts first and finds no parent yet
    time.sleep(2.0)
    with pipeline_session(cfg, config, layout, "training", group=first, specs=(STAGE_DATA,)) as s:
        execute_stage(STAGE_DATA, s)  # task 0: makes the parent
        made.append(s.parent_id)
    joiner.join(60)
    with pipeline_session(cfg, config, layout, "enn validate", group=first) as later:
        made.append(later.parent_id)  # a later step of the job
    assert len(set(made)) == 1 and len(made) == 3, made
    client = MlflowClient(tracking_uri=uri)
    parents = client.search_runs(
        [later.tracker.experiment_id], "tags.`enn.kind` = 'pipeline'", max_results=10
    )
    assert [p.info.run_id for p in parents] == made[:1]
    assert parents[0].data.tags["enn.slurm.job_id"] == "77"
    assert parents[0].info.status == "FINISHED"
    # another job: a parent of its own; a task whose first task never made one goes on alone
    monkeypatch.setattr(sessions, "JOIN_WAIT_S", 1.0)
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    monkeypatch.setenv("SLURM_PROCID", "1")
    with pipeline_session(cfg, config, layout, "training", group=slurm_group()) as alone:
        assert alone.parent_id not in made
    monkeypatch.setenv("SLURM_JOB_ID", "not-slurm")
    assert slurm_group() is None
