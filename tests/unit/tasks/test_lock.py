"""The pipeline lock (tasks/lock.py): one pipeline run per work directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from enn_core.errors import LockError
from tests.fixtures.project import ROOT


@pytest.mark.timeout(60)
def test_lock_refuses_a_second_pipeline_run(tmp_path):
    from tasks.lock import pipeline_lock

    lock = tmp_path / "work" / "pipeline.lock"
    with pipeline_lock(lock, "first run"):
        with pipeline_lock(lock, "nested"):  # re-entrant in one process
            pass
        code = (
            "import sys; from pathlib import Path; from tasks.lock import pipeline_lock\n"
            f"with pipeline_lock(Path({str(lock)!r}), 'second'): pass\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=ROOT
        )
        assert out.returncode != 0
        assert "another pipeline run holds this work directory" in out.stderr
        assert f"pid {os.getpid()}" in out.stderr and "first run" in out.stderr
    with pipeline_lock(lock, "after release"):
        pass
    # an error inside the locked block releases the lock
    with pytest.raises(LockError):
        with pipeline_lock(lock, "a"):
            raise LockError("propagates")
    with pipeline_lock(lock, "free again"):
        pass


def _second_run(lock) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys; from pathlib import Path; from tasks.lock import pipeline_lock\n"
        f"with pipeline_lock(Path({str(lock)!r}), 'second'): pass\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=ROOT
    )


@pytest.mark.timeout(60)
def test_the_last_holder_of_the_process_releases_the_lock(tmp_path):
    """A holder in another thread (a batch job's sessions in Prefect's task threads) leaves
    after the one that took the lock: the lock stays held until it does (before: the first
    one's exit released it under the other, whose exit then failed with a KeyError)."""
    import threading

    from tasks.lock import pipeline_lock

    lock = tmp_path / "work" / "pipeline.lock"
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with pipeline_lock(lock, "the other session"):
            inside.set()
            leave.wait(30)

    with pipeline_lock(lock, "first"):
        thread = threading.Thread(target=other)
        thread.start()
        assert inside.wait(30)
    out = _second_run(lock)  # the first left; the other session is still inside
    assert out.returncode != 0 and "another pipeline run holds" in out.stderr, out.stderr
    leave.set()
    thread.join(30)
    assert _second_run(lock).returncode == 0  # the last one out released it
