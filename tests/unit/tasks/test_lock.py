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
