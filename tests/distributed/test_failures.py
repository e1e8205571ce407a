"""Hangs, raising workers, cancellation and faults on one rank only: the caller learns which
rank and phase, and no worker process outlives the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from enn_core.errors import WorkerError
from enn_core.runtime.heartbeat import read_heartbeats
from tests.fixtures.distributed import alive, cfg_of, run_train, worker_pids
from tests.fixtures.project import ROOT

HANG = 8.0


@pytest.mark.timeout(180)
def test_hang_in_first_forward_names_the_silent_rank_with_stacks(tiny_project):
    cfg = cfg_of(
        f"runtime.hang_timeout_s={HANG}",
        "fault.kind=hang",
        "fault.phase=first_forward",
        "fault.rank=1",
    )
    with pytest.raises(
        WorkerError, match=r"rank 1 hung in phase first_forward.*rank\(s\) \[0\] were waiting"
    ) as e:
        run_train(tiny_project, cfg)
    ended = time.time()
    run_dir = Path(str(e.value).split("stacks of every rank in ")[1]).parent
    beats = read_heartbeats(run_dir)
    assert ended - beats[1]["progress_time"] < 3 * HANG  # caught well before 3 x hang_timeout
    stacks = (run_dir / "stacks" / "rank-1.txt").read_text()
    assert "fault.py" in stacks and "in at" in stacks  # the sleeping frame is visible
    assert "torch/distributed" in (run_dir / "stacks" / "rank-0.txt").read_text()  # the peer waits
    assert alive(worker_pids(run_dir)) == []


@pytest.mark.timeout(180)
def test_worker_that_raises_reaches_the_caller_with_its_rank(tiny_project):
    cfg = cfg_of("fault.kind=raise", "fault.phase=step", "fault.step=3", "fault.rank=1")
    with pytest.raises(
        WorkerError, match=r"rank 1 failed in phase step step 3: InjectedFault: injected fault"
    ) as e:
        run_train(tiny_project, cfg)
    run_dir = Path(str(e.value).split("(logs in ")[1].rstrip(")")).parent
    time.sleep(1.0)
    assert alive(worker_pids(run_dir)) == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["nan", "oom"])
def test_fault_on_one_rank_is_agreed_by_every_rank(tiny_project, kind):
    summary, _ = run_train(
        tiny_project,
        cfg_of(f"fault.kind={kind}", "fault.phase=step", "fault.step=2", "fault.rank=1"),
    )
    r0, r1 = summary["ranks"][0], summary["ranks"][1]
    if kind == "nan":
        assert r0["skipped_steps"] == r1["skipped_steps"] == 1
    else:
        assert (
            r0["oom_backoffs"] == r1["oom_backoffs"] == 1
            and r0["micro_batch"] == r1["micro_batch"] == 2
        )
    assert (
        r0["step_losses_sha"] == r1["step_losses_sha"]
        and r0["applied_steps"] == r1["applied_steps"]
    )


CHILD = """
from tests.fixtures.distributed import cfg_of, run_train
from enn_core.paths import Layout
run_train(Layout.for_root({root!r}), cfg_of("train.epochs=200"))
"""


@pytest.mark.timeout(180)
def test_ctrl_c_leaves_no_worker_behind(tiny_project):
    code = CHILD.format(root=str(tiny_project.root))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    runs = tiny_project.work / "runs"
    deadline = time.time() + 120
    pids: list[int] = []
    while time.time() < deadline:  # wait until both workers are training
        beats = [
            json.loads(p.read_text())
            for p in runs.glob("*/distributed-train/heartbeats/rank-*.json")
        ]
        if len(beats) == 2 and all(b["phase"] == "step" for b in beats):
            pids = [b["pid"] for b in beats]
            break
        time.sleep(0.5)
    assert len(pids) == 2, (
        proc.stdout.read().decode()[-2000:] if proc.poll() is not None else "workers never started"
    )
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    end = time.time() + 10
    while alive(pids) and time.time() < end:
        time.sleep(0.2)
    assert alive(pids) == []
    assert proc.returncode != 0
