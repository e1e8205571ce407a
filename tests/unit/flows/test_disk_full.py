"""A full disk is one line (exit 11) and nothing else: not the OSError traceback of the first
write that hit it, not "--- Logging error ---" per record from a log file that cannot grow (a
flow's printed lines are logged, so each of those printed again, until a RecursionError), not
a library's traceback of the store it could not write."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from enn_core.errors import NoSpaceError
from flows import console
from tests.fixtures.project import ROOT, contained_env


def fill(disk: Path, leave: int = 0) -> None:
    """Write until the disk refuses, then give back `leave` bytes."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    if leave:
        os.truncate(filler, max(0, filler.stat().st_size - leave))


@pytest.mark.parametrize(
    ("leave", "commands"),
    [(0, (["stage-data"], ["run", "--until", "stage-data"])), (96 << 10, (["run"],))],
)
def test_a_command_on_a_full_disk_says_one_line(tmp_path, tmpfs, leave, commands):
    """Full: the pipeline lock's first write was an OSError traceback, exit 1. Nearly full:
    Prefect's API could not make its database and `enn run` said "server exited with 3"."""
    disk = tmpfs(tmp_path / "disk", size="1m")
    (disk / "work").mkdir()
    fill(disk, leave)
    (tmp_path / "params.yaml").write_text("tracking: {enabled: false}\n")
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    env = contained_env(tmp_path, PYTHONPATH=str(ROOT), ENN_WORK_DIR=str(disk / "work"))
    for argv in commands:
        out = subprocess.run(
            [sys.executable, "-m", "flows.cli", *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode == 11, out.stderr
        assert len(lines) == 1 and "no space left on the device" in lines[0], lines


def test_the_log_file_on_a_full_disk_stops_quietly(tmp_path, tmpfs, capfd):
    disk = tmpfs(tmp_path / "disk", size="1m")
    saved = logging.getLogger().handlers[:], logging.raiseExceptions
    try:
        console.setup(disk / "logs", "run")
        fill(disk)
        log = logging.getLogger("enn.test")
        for i in range(200):  # past the file's buffer: the writes reach the full disk
            log.info("line %d %s", i, "x" * 200)
        log.warning("still on the console")
    finally:
        root = logging.getLogger()
        root.handlers, logging.raiseExceptions = saved
    err = capfd.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err, err[-2000:]
    assert "still on the console" in err


def test_a_library_wrapped_full_disk_is_named_as_one(tmp_path, tmpfs):
    """MLflow raises MlflowException("database or disk is full"), Prefect an HTTP 500 when
    its server's database is full: whatever the wrapper, a full disk is the error."""
    from enn_core.errors import no_space_behind

    disk = tmpfs(tmp_path / "disk", size="1m")
    fill(disk)
    wrapped = RuntimeError("(sqlite3.OperationalError) database or disk is full")
    full = no_space_behind(wrapped, [disk / "work", tmp_path])
    assert isinstance(full, NoSpaceError) and str(disk / "work") in str(full)
    assert no_space_behind(RuntimeError("a bug"), [tmp_path]) is None  # room there: not it
    enospc = OSError(28, os.strerror(28), str(tmp_path / "x"))
    assert isinstance(no_space_behind(enospc, [tmp_path]), NoSpaceError)
