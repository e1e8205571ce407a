"""One worker of one node, never restarted, starts as the worker entry itself (no torchrun):
rank 0 of 1 with its own store, its result, its error and its death told as torchrun's would
be, its output in the run directory's log, and nothing left running."""

from __future__ import annotations

import json
import os
import signal

import psutil
import pytest

from enn_core.errors import ConfigError, OutOfMemory
from enn_core.runtime.launch import launch


def describe() -> dict[str, object]:
    """What the worker sees: its parent and the variables torchrun would have set."""
    print("a line of the worker's own output")
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
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
    }
