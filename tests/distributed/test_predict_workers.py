"""Spawned prediction workers: same output as one process, failures name the rank, resume."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from enn_core.config import FaultConfig
from enn_core.errors import WorkerError
from enn_core.predict.assemble import assemble
from enn_core.predict.chunks import PartsPlan, PartStore
from enn_core.predict.workers import WorkerJob, predict_parts, run_workers
from tests.fixtures.predict import OUT_SHAPE, load_tiny, make_features
from tests.fixtures.project import ROOT


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
    store = PartStore(tmp_path / name, plan)
    store.prepare()
    jobs = [
        WorkerJob(
            rank=r,
            world_size=world,
            parts_dir=str(store.root),
            plan=plan,
            features_path=str(feats),
            index_path=None,
            batch_size=3,
            loader=functools.partial(load_tiny, 3, 0),
            fault=fault or FaultConfig(),
            fault_marker_dir=str(tmp_path / f"faults-{name}"),
        )
        for r in range(world)
    ]
    return store, jobs


@pytest.mark.timeout(120)
def test_two_workers_match_one_process_and_resume_after_a_killed_worker(tmp_path):
    ref_store, ref_jobs = _setup(tmp_path, "ref", 1)
    predict_parts(ref_jobs[0])
    ref = np.array(assemble(ref_store, tmp_path / "ref.npy"))

    # rank 1 owns parts 4..8; it SIGKILLs itself after finishing part 5
    store, jobs = _setup(
        tmp_path, "two", 2, FaultConfig(kind="kill", phase="predict_chunk", step=5)
    )
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1/2 failed \(killed by signal 9\)"):
        run_workers(jobs)
    assert time.monotonic() - t0 < 90
    assert store.is_done(4) and store.is_done(5) and not store.is_done(8)

    store.prepare()
    jobs = [dataclasses.replace(j, fault=FaultConfig()) for j in jobs]
    stats = run_workers(jobs)
    assert stats[1]["reused_parts"][:2] == [4, 5] and 4 not in stats[1]["computed_parts"]
    out = np.array(assemble(store, tmp_path / "two.npy"))
    assert out.tobytes() == ref.tobytes()


def test_worker_error_is_reported_in_one_line(tmp_path):
    store, jobs = _setup(tmp_path, "bad", 2)
    jobs = [dataclasses.replace(j, features_path=str(tmp_path / "missing.npy")) for j in jobs]
    with pytest.raises(
        WorkerError, match=r"rank \d/2 failed \(FileNotFoundError: .*missing.npy"
    ) as e:
        run_workers(jobs)
    assert "\n" not in str(e.value)
    assert os.getpid()  # the caller survived


@pytest.mark.timeout(120)
def test_a_hung_worker_is_found_by_its_heartbeat(tmp_path):
    fault = FaultConfig(kind="hang", phase="predict_chunk", step=0, seconds=120)
    store, jobs = _setup(tmp_path, "hang", 2, fault)
    jobs = [dataclasses.replace(j, hang_timeout_s=3.0) for j in jobs]
    t0 = time.monotonic()
    with pytest.raises(
        WorkerError, match=r"rank 0/2 made no progress for \d+ s .*phase predict_part step 0"
    ):
        run_workers(jobs)
    assert time.monotonic() - t0 < 60
    assert "predict_parts" in (store.root / "stacks" / "rank-0.txt").read_text()


DIE_DRIVER = """
import dataclasses, sys
import tests.distributed.test_predict_workers as t
from pathlib import Path
from enn_core.config import FaultConfig
from enn_core.predict.workers import run_workers
fault = FaultConfig(kind="hang", phase="predict_chunk", seconds=300)
store, jobs = t._setup(Path(sys.argv[1]), "orphans", 2, fault)
run_workers(jobs)
"""


@pytest.mark.timeout(120)
def test_workers_die_with_a_killed_caller(tmp_path):
    import psutil

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    caller = subprocess.Popen([sys.executable, "-c", DIE_DRIVER, str(tmp_path)], env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        children = []
        while time.monotonic() < deadline and len(children) < 2:
            children = [c for c in psutil.Process(caller.pid).children() if "python" in c.name()]
            time.sleep(0.2)
        assert len(children) >= 2
        while not list((tmp_path / "orphans").glob("*.done")) and time.monotonic() < deadline:
            time.sleep(0.2)  # the workers are running the model
        caller.kill()
        caller.wait(10)
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"orphaned workers: {[p.pid for p in alive]}"
    finally:
        if caller.poll() is None:
            caller.kill()
