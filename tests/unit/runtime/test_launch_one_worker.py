"""One worker of one node, never restarted, starts as the worker entry itself (no torchrun):
rank 0 of 1 with its own store, its result, its error and its death told as torchrun's would
be, its output in the run directory's log, and nothing left running."""

from __future__ import annotations

import json
import os
import signal

import psutil
import pytest

from enn_core.errors import ConfigError, OutOfMemory, WorkerError
from enn_core.runtime.launch import launch


def describe() -> dict[str, object]:
    """What the worker sees: its parent and the variables torchrun would have set."""
    print("a line of the worker's own output")
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    keys += ("MLFLOW_TRACKING_URI",)
    return {"ppid": os.getppid(), "pid": os.getpid(), **{k: os.environ.get(k) for k in keys}}


def refuse() -> None:
    raise ConfigError("data.path: no such file; set data.path")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_one_worker_is_a_direct_child_with_rank_zero_of_one(tmp_path):
    got = launch(describe, (), nprocs=1, run_dir=tmp_path, hang_timeout_s=60)[0]
    assert got["ppid"] == os.getpid()  # no torchrun between
    assert (got["RANK"], got["LOCAL_RANK"], got["WORLD_SIZE"], got["LOCAL_WORLD_SIZE"]) == (
        "0",
        "0",
        "1",
        "1",
    )
    assert got["MASTER_ADDR"] == "127.0.0.1" and int(str(got["MASTER_PORT"])) > 0
    assert "a line of the worker's own output" in (tmp_path / "logs" / "rank-0.log").read_text()
    assert not (tmp_path / "logs" / "torchrun.log").exists()
    ended = json.loads((tmp_path / "launch" / "exits.json").read_text())
    assert ended["state"] == "succeeded"
    assert not psutil.pid_exists(int(str(got["pid"]))) or (
        psutil.Process(int(str(got["pid"]))).status() == psutil.STATUS_ZOMBIE
    )


def test_restarts_still_go_through_torchrun(tmp_path):
    got = launch(describe, (), nprocs=1, run_dir=tmp_path, hang_timeout_s=60, max_restarts=1)[0]
    assert got["ppid"] != os.getpid()  # torchrun's agent restarts a failed worker
    assert (tmp_path / "logs" / "torchrun.log").exists()


def test_a_direct_workers_error_keeps_its_class(tmp_path):
    with pytest.raises(ConfigError, match=r"rank 0 failed in phase entry: ConfigError: data.path"):
        launch(refuse, (), nprocs=1, run_dir=tmp_path, hang_timeout_s=60)


def test_a_direct_worker_killed_below_python_is_named_with_its_signal(tmp_path):
    """SIGKILL, which the launcher did not send: most likely the kernel's out-of-memory killer
    (issue 51), said in one line with the out-of-memory exit code."""
    with pytest.raises(OutOfMemory) as e:
        launch(die, (), nprocs=1, run_dir=tmp_path, hang_timeout_s=60)
    assert str(e.value).startswith(
        "rank 0 was killed by signal 9 (SIGKILL, no Python error), most likely by the kernel's "
        "out-of-memory killer (`dmesg`"
    )
    assert "\n" not in str(e.value) and e.value.exit_code == 13
    ended = json.loads((tmp_path / "launch" / "exits.json").read_text())
    assert ended == {
        "state": "failed",
        "exits": {"0": -9},
        "message": "rank 0 exit -9",
        "worker": "started",
    }


def test_a_spare_worker_takes_the_job_and_an_unused_one_ends(tmp_path):
    """A spare (started before its job, importing the worker's module) is the process that
    runs the next one-worker job, its output in that job's log; one no job took ends with
    its block."""
    from enn_core.runtime.launch import spare_worker
    from enn_core.runtime.spare import _spare

    run_dir = tmp_path / "work" / "runs" / "r1" / "distributed-train"  # a stage's, as a flow's
    with spare_worker("json", tmp_path / "work"):
        spare = _spare[0].proc
        got = launch(describe, (), nprocs=1, run_dir=run_dir, hang_timeout_s=60)[0]
    assert got["pid"] == spare.pid and got["ppid"] == os.getpid()
    assert json.loads((run_dir / "launch" / "exits.json").read_text())["worker"] == "spare"
    assert (got["RANK"], got["WORLD_SIZE"]) == ("0", "1")
    assert "a line of the worker's own output" in (run_dir / "logs/rank-0.log").read_text()
    with spare_worker("json", tmp_path / "work"):
        unused = _spare[0].proc
    assert unused.returncode is not None and not _spare  # ended with its block


def test_a_spare_that_does_not_fit_the_job_is_let_go(tmp_path, monkeypatch):
    """A variable changed since the spare started (it may have been read at import): the
    spare ends and a fresh worker runs the job."""
    from enn_core.runtime.launch import spare_worker
    from enn_core.runtime.spare import _spare

    with spare_worker("json", tmp_path / "work"):
        spare = _spare[0].proc
        monkeypatch.setenv("OMP_NUM_THREADS", "7")
        run_dir = tmp_path / "work" / "runs" / "r1" / "distributed-train"
        got = launch(describe, (), nprocs=1, run_dir=run_dir, hang_timeout_s=60)[0]
    assert got["pid"] != spare.pid and spare.returncode is not None


def test_the_tools_settings_may_change_before_the_spare_is_taken(tmp_path, monkeypatch):
    """MLflow's client sets MLFLOW_TRACKING_URI when the run's tracker starts, after the
    spare did: the spare still takes the job, and runs it with the job's value."""
    from enn_core.runtime.launch import spare_worker
    from enn_core.runtime.spare import _spare

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///before.db")
    run_dir = tmp_path / "work" / "runs" / "r1" / "distributed-train"
    with spare_worker("json", tmp_path / "work"):
        spare = _spare[0].proc
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
        got = launch(describe, (), nprocs=1, run_dir=run_dir, hang_timeout_s=60)[0]
    assert got["pid"] == spare.pid
    assert got["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000"


def test_a_spare_whose_import_failed_fails_the_job_with_that_error_in_its_log(tmp_path):
    from enn_core.runtime.launch import spare_worker

    run_dir = tmp_path / "work" / "runs" / "r1" / "distributed-train"
    with (
        spare_worker("enn_core.no_such_module", tmp_path / "work"),
        pytest.raises(
            WorkerError, match=r"rank 0 failed in phase entry: ModuleNotFoundError: No module named"
        ),
    ):
        launch(describe, (), nprocs=1, run_dir=run_dir, hang_timeout_s=60)
    assert "enn_core.no_such_module" in (run_dir / "logs" / "rank-0.log").read_text()


def test_a_spare_is_started_and_let_go_through_the_process_table(tmp_path):
    """The spare is a child of enn_core.runtime.children: listed while it waits, out of the
    table once its block let it go."""
    from enn_core.runtime import children
    from enn_core.runtime.launch import spare_worker
    from enn_core.runtime.spare import _spare

    with spare_worker("json", tmp_path / "work"):
        made = _spare[0].proc
        assert {c.pid: c.kind for c in children.running()}.get(made.pid) == "spare-worker"
    assert made.returncode is not None
    assert made.pid not in {c.pid for c in children.running()}
