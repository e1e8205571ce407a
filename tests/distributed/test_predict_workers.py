"""Prediction's launched ranks on one node: same output as one process, failures name the
rank, a hang is found by its heartbeat, resume, and no worker outlives a killed caller."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from enn_core.config import FaultConfig
from enn_core.errors import OutOfMemory, WorkerError
from enn_core.predict.assemble import assemble
from enn_core.predict.chunks import PartsPlan
from enn_core.predict.ranks import Limits, RankJob, launch_ranks
from enn_core.predict.workers import Loader, WorkerJob, predict_parts
from enn_core.runtime.network import InterfaceChoice
from tests.fixtures.predict import OUT_SHAPE, job_secret, make_features, parts_store
from tests.fixtures.project import ROOT

LIMITS = Limits(hang_timeout_s=60.0, spawn_s=90.0, timeout_s=300.0)


def _setup(tmp_path, name, world, fault=None):
    feats = tmp_path / "features.npy"
    if not feats.exists():
        np.save(feats, make_features(70))
    plan = PartsPlan(
        n_rows=70,
        rows_per_part=8,
        out_shape=OUT_SHAPE,
        dtype="float32",
        model_fingerprint="m",
        input_fingerprint="i",
    )
    store = parts_store(tmp_path / name, plan, tmp_path / "work")
    store.prepare()
    job = WorkerJob(
        rank=0,
        world_size=world,
        parts_dir=str(store.root),
        plan=plan,
        features_path=str(feats),
        index_path=None,
        batch_size=3,
        loader=Loader("tests.fixtures.predict:load_tiny", (3, 0)),
        fault=fault or FaultConfig(),
        fault_marker_dir=str(tmp_path / f"faults-{name}"),
        secret_file=job_secret(tmp_path / "work"),
    )
    return store, job


def _spec(job: WorkerJob, run_dir: Path) -> RankJob:
    return RankJob(
        job=job,
        run_dir=str(run_dir),
        interface=InterfaceChoice("lo", "one node"),
        barrier_timeout_s=120.0,
        device="cpu",
    )


@pytest.mark.timeout(300)
def test_two_workers_match_one_process_and_resume_after_a_killed_worker(tmp_path):
    ref_store, ref_job = _setup(tmp_path, "ref", 1)
    predict_parts(ref_job)
    ref = np.array(assemble(ref_store, tmp_path / "ref.npy"))

    # rank 1 owns parts 4..8; it SIGKILLs itself after finishing part 5
    store, job = _setup(tmp_path, "two", 2, FaultConfig(kind="kill", phase="predict_chunk", step=5))
    t0 = time.monotonic()
    with pytest.raises(
        OutOfMemory, match=r"rank 1 was killed by signal 9 \(SIGKILL.*are kept"
    ) as e:
        launch_ranks(_spec(job, tmp_path / "work" / "runs" / "job1" / "predict"), 2, LIMITS)
    assert time.monotonic() - t0 < 240
    assert "\n" not in str(e.value)
    assert store.is_done(4) and store.is_done(5) and not store.is_done(8)

    store.prepare()
    job = dataclasses.replace(job, fault=FaultConfig())
    # the stage's run directories (work/runs/<id>/predict): both launches sign their parts with
    # the work directory's own job secret, so the second one trusts the first one's parts
    stats = launch_ranks(_spec(job, tmp_path / "work" / "runs" / "job2" / "predict"), 2, LIMITS)
    assert stats[1]["reused_parts"][:2] == [4, 5] and 4 not in stats[1]["computed_parts"]
    out = np.array(assemble(store, tmp_path / "two.npy"))
    assert out.tobytes() == ref.tobytes()


@pytest.mark.timeout(300)
def test_worker_error_is_reported_in_one_line(tmp_path):
    store, job = _setup(tmp_path, "bad", 2)
    job = dataclasses.replace(job, features_path=str(tmp_path / "missing.npy"))
    with pytest.raises(
        WorkerError, match=r"rank \d failed in phase \w+: FileNotFoundError: .*missing.npy"
    ) as e:
        launch_ranks(_spec(job, tmp_path / "run"), 2, LIMITS)
    assert "\n" not in str(e.value)
    assert os.getpid()  # the caller survived


@pytest.mark.timeout(300)
def test_a_hung_worker_is_found_by_its_heartbeat(tmp_path):
    fault = FaultConfig(kind="hang", phase="predict_chunk", step=0, seconds=120)
    store, job = _setup(tmp_path, "hang", 2, fault)
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    with pytest.raises(
        WorkerError, match=r"rank 0 hung in phase predict_part step 0 \(no progress for \d+ s"
    ):
        launch_ranks(_spec(job, run_dir), 2, dataclasses.replace(LIMITS, hang_timeout_s=3.0))
    assert time.monotonic() - t0 < 240
    assert "predict_parts" in (run_dir / "stacks" / "rank-0.txt").read_text()


DIE_DRIVER = """
import sys
import tests.distributed.test_predict_workers as t
from pathlib import Path
from enn_core.config import FaultConfig
from enn_core.predict.ranks import launch_ranks
fault = FaultConfig(kind="hang", phase="predict_chunk", seconds=300)
store, job = t._setup(Path(sys.argv[1]), "orphans", 2, fault)
launch_ranks(t._spec(job, Path(sys.argv[1]) / "run"), 2, t.LIMITS)
"""


@pytest.mark.timeout(300)
def test_workers_die_with_a_killed_caller(tmp_path):
    import psutil

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    caller = subprocess.Popen([sys.executable, "-c", DIE_DRIVER, str(tmp_path)], env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 240
        children: list[psutil.Process] = []
        while time.monotonic() < deadline and len(children) < 3:  # torchrun and two workers
            children = [
                c
                for c in psutil.Process(caller.pid).children(recursive=True)
                if "python" in c.name()
            ]
            time.sleep(0.2)
        assert len(children) >= 3
        while not list((tmp_path / "orphans").glob("*.done")) and time.monotonic() < deadline:
            time.sleep(0.2)  # the workers are running the model
        caller.kill()
        caller.wait(10)
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"orphaned workers: {[p.pid for p in alive]}"
    finally:
        if caller.poll() is None:
            caller.kill()
