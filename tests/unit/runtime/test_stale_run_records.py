"""An earlier launch's records in a reused run directory (a Prefect retry, a SLURM group's
run id) decide nothing about the next launch: a stale heartbeat does not make the watchdog
kill the new workers as hung, a stale error record does not choose the new error's class,
and a file in those folders that is not a record is skipped, never a crash of the parent.
A link planted in the run directory where a log goes is one line, never written through."""

from __future__ import annotations

import json
import time

import pytest

from enn_core.errors import ConfigError
from enn_core.runtime.heartbeat import read_heartbeats
from enn_core.runtime.launch import launch, read_errors
from tests.unit.runtime.test_launch_one_worker import describe, refuse


def _leftovers(run_dir, rank: int = 1) -> None:
    """What a launch of two workers, the first try of this run, left behind."""
    old = time.time() - 600
    beats, errors = run_dir / "heartbeats", run_dir / "errors"
    beats.mkdir(parents=True)
    errors.mkdir()
    beat = {"rank": rank, "pid": 1, "attempt": 0, "phase": "step", "step": 3}
    (beats / f"rank-{rank}.json").write_text(json.dumps({**beat, "progress_time": old}))
    error = {"rank": rank, "type": "DataError", "message": "an old failure", "phase": "step"}
    (errors / f"rank-{rank}.json").write_text(json.dumps({**error, "step": 3, "time": old}))


def test_a_stale_heartbeat_of_an_earlier_launch_is_not_a_hang_of_this_one(tmp_path):
    _leftovers(tmp_path)
    got = launch(describe, (), nprocs=1, run_dir=tmp_path, hang_timeout_s=5)[0]
    assert got["RANK"] == "0"
    assert 1 not in read_heartbeats(tmp_path)  # the earlier launch's rank is gone


def test_a_stale_error_record_does_not_choose_this_launchs_error(tmp_path):
    _leftovers(tmp_path)
    with pytest.raises(ConfigError, match=r"rank 0 failed in phase entry: ConfigError: data.path"):
        launch(refuse, (), nprocs=1, run_dir=tmp_path, hang_timeout_s=60)


@pytest.mark.parametrize("raw", ["[]", '{"rank": "x"}', '{"time": 1}', "null", '"text"'])
def test_a_file_that_is_no_record_is_skipped(tmp_path, raw):
    for sub in ("heartbeats", "errors"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "rank-0.json").write_text(raw)
    assert read_heartbeats(tmp_path) == {} and read_errors(tmp_path) == []


@pytest.mark.parametrize("log", ["rank-0.log", "torchrun.log"])
def test_a_log_link_planted_in_the_run_directory_is_never_written_through(tmp_path, log):
    from enn_core.errors import DataError

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "run" / "logs").mkdir(parents=True)
    (tmp_path / "run" / "logs" / log).symlink_to(victim)
    restarts = 1 if log == "torchrun.log" else 0  # torchrun only where it restarts workers
    with pytest.raises(DataError, match=rf"{log} is a link or not a plain file"):
        launch(
            describe,
            (),
            nprocs=1,
            run_dir=tmp_path / "run",
            hang_timeout_s=60,
            max_restarts=restarts,
        )
    assert victim.read_text() == "precious"


def test_a_pipe_planted_where_a_log_goes_is_one_line_not_a_hang(tmp_path):
    import os

    from enn_core.atomic import open_own
    from enn_core.errors import DataError

    os.mkfifo(tmp_path / "rank-0.log")  # nobody reads it: a plain open would block forever
    with pytest.raises(DataError, match=r"rank-0.log is a link or not a plain file"):
        open_own(tmp_path / "rank-0.log")
