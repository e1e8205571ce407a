"""After a failed launch (a full disk), the temp files its workers left are swept: half-written
checkpoints and the heartbeat temp files of writers that are gone, not those of a live one."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

from enn_core.runtime.heartbeat import HEARTBEATS, heartbeat_path
from enn_core.train.job import CheckpointPlan
from enn_core.train.stage import sweep_temp


def test_sweep_removes_temp_files_of_gone_writers_and_keeps_a_live_ones(tmp_path):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = int(gone.stdout)
    beats = run_dir / HEARTBEATS
    beats.mkdir(parents=True)
    heartbeat_path(run_dir, 0).write_text("{}")
    left = [beats / f".rank-0.json.{dead}.140201.tmp", beats / f".rank-1.json.{dead}.140202.tmp"]
    for p in left:
        p.write_text('{"rank": 0, "ph')  # the write that ran out of space
    writing = beats / f".rank-1.json.{os.getpid()}.140203.tmp"  # a writer still alive
    writing.write_text("{}")
    (ckpt / ".tmp-step-00000005-a0").mkdir(parents=True)
    (run_dir / "result" / ".tmp-record.json").parent.mkdir()
    (run_dir / "result" / ".tmp-record.json").write_text("{")
    job = SimpleNamespace(checkpoint=CheckpointPlan(dir=ckpt, digest="d"))
    sweep_temp(SimpleNamespace(run_dir=run_dir), job)  # type: ignore[arg-type]
    assert not any(p.exists() for p in left)
    assert writing.exists() and heartbeat_path(run_dir, 0).exists()
    assert not list(ckpt.glob(".tmp-*")) and not list(run_dir.rglob(".tmp-*"))
