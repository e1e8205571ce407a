"""The pipeline's MLflow parent run shows what this run made: a run that fails before its
stage-data finished is not logged with the previous run's input dataset (issue 32)."""

from __future__ import annotations

import pytest

from enn_core.config import load_config
from enn_core.errors import ConfigError, DataError
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


def test_the_commands_of_one_batch_job_share_one_parent_run(tmp_path, monkeypatch):
    """Every `enn` of a batch job whose script names its group (`ENN_RUN_GROUP`, as
    deploy/slurm/ does: each node's task, each later step, a requeued run) records under one
    parent run: the job's first task makes it; on a shared store a later task waits for it
    rather than making a second when both start at once; another job gets its own; and
    without the variable (an `salloc` shell running several pipelines) nothing is merged."""
    import threading
    import time

    from mlflow.tracking import MlflowClient

    from tasks import session as sessions
    from tasks.runner import execute_stage
    from tasks.session import batch_group, job_group, pipeline_session
    from tasks.tracking import runs

    (tmp_path / "params.yaml").write_text("{}\n")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(None, [*tiny_overrides(), f"tracking.uri={uri}"])
    layout = Layout.for_root(tmp_path)
    config = tmp_path / "params.yaml"
    for name in ("DVC_STAGE", "RANK", sessions.GROUP_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert job_group() is None  # SLURM alone merges nothing
    monkeypatch.setenv(sessions.GROUP_ENV, "slurm-77")
    monkeypatch.setenv("SLURM_PROCID", "1")  # node2's task: waits for task 0's parent
    second = batch_group()
    assert second is not None and not second.makes and second.key == "slurm-77"
    monkeypatch.setenv("RANK", "0")  # a torchrun worker: only global rank 0 records
    assert batch_group() == sessions.ParentGroup("slurm-77", makes=True)
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("SLURM_PROCID", "0")
    first = job_group()
    assert first is not None and first.makes and not first.run_dirs
    # the test's SQLite store stands for a shared server (where a later task must wait)
    monkeypatch.setattr(runs, "LOCAL_STORES", ())
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
    # a task whose first task never made one waits, then goes on under a parent of its own,
    # outside the group (a later step of the job still finds the job's one)
    monkeypatch.setattr(sessions, "JOIN_WAIT_S", 1.0)
    monkeypatch.setenv(sessions.GROUP_ENV, "slurm-78")
    monkeypatch.setenv("SLURM_PROCID", "1")
    with pipeline_session(cfg, config, layout, "training", group=batch_group()) as alone:
        assert alone.parent_id not in made
    assert "enn.group" not in client.get_run(str(alone.parent_id)).data.tags
    # a local store is this machine's alone: no wait there, its own parent at once
    monkeypatch.setattr(runs, "LOCAL_STORES", ("sqlite:",))
    monkeypatch.setattr(sessions, "JOIN_WAIT_S", 60.0)
    monkeypatch.setenv(sessions.GROUP_ENV, "slurm-79")
    t0 = time.monotonic()
    with pipeline_session(cfg, config, layout, "training", group=batch_group()) as local:
        assert local.parent_id not in made
    assert time.monotonic() - t0 < 30
    assert client.get_run(str(local.parent_id)).data.tags["enn.group"] == "slurm-79"
    monkeypatch.setenv(sessions.GROUP_ENV, "slurm-1' or '1'='1")
    with pytest.raises(ConfigError, match="ENN_RUN_GROUP"):
        batch_group()


def test_a_stopped_batch_job_ends_its_parent_killed_named_like_the_training_runs(
    tmp_path, monkeypatch
):
    """Issue 54: a cancelled SLURM job's parent run, made by the worker's `enn
    distributed-train` (its stage-data was up to date, so `enn run` made none), stayed RUNNING
    until the next job and was named `enn distributed-train #1 @node1 synthetic
    checkpoint.dir=/abs/path...`. Now a stage that the workers stopped (`Preempted`: they
    saved) ends its run and the parent KILLED, and the parent is named as the job's `enn run`
    names it: the flow, its number, the data, what the run computes differently."""
    import dataclasses

    from mlflow.tracking import MlflowClient

    from enn_core.errors import Preempted
    from flows.commands import run_stage_command
    from tasks import session as sessions
    from tasks.tracking.runs import TAG_ERROR

    root = tmp_path / "proj"
    (root / ".dvc").mkdir(parents=True)
    (root / "dvc.yaml").write_text("stages: {}\n")
    (root / "params.yaml").write_text("{}\n")
    for name in ("DVC_STAGE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(sessions.GROUP_ENV, "slurm-91")
    monkeypatch.setenv("SLURM_PROCID", "0")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    shared = tmp_path / "shared" / "enn-checkpoints"  # outside the project, as $ENN_SHARED
    overrides = [f"checkpoint.dir={shared}", "runtime.max_restarts=1", "train.lr=0.02"]
    cfg = load_config(root / "params.yaml", [*tiny_overrides(), f"tracking.uri={uri}", *overrides])

    def saved_and_stopped(cfg, ctx):
        raise Preempted("saved for preemption at step 6; run the same command again to resume")

    stage = dataclasses.replace(STAGE_DATA, work=saved_and_stopped)
    with pytest.raises(Preempted):
        run_stage_command(stage, cfg, root / "params.yaml", Layout.for_root(root), overrides)
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (parent,) = [r for r in runs if r.data.tags.get("enn.kind") == "pipeline"]
    (child,) = [r for r in runs if r.data.tags.get("enn.kind") == "stage"]
    assert parent.info.run_name == "training #1 synthetic train.lr=0.02", parent.info.run_name
    assert parent.info.status == child.info.status == "KILLED"
    assert "Preempted" in parent.data.tags[TAG_ERROR]
    assert str(shared) in parent.data.tags["enn.overrides"]  # every --set is still recorded
