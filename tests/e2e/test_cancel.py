"""Stopping a run from outside ends every process it started, within a generous deadline.

- The flow run is cancelled through the Prefect API (`prefect flow-run cancel`, against the
  temporary server `enn run` started): the flow run ends Cancelled, `enn` exits 130.
- SIGTERM to `enn run` (Prefect's engine owns SIGTERM during a flow) and to `enn
  distributed-train` (no Prefect): exit 143 with a one-line message.
Each time: no process `enn` started is left (workers, Prefect's server), the lock is free.

One project for the module: the first `enn run` stages the data and the initial checkpoint
(DVC records them), so later runs go straight to training.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import Project, make_project

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
STAGES = ("stage-data", "prepare-checkpoint", "distributed-train")
LONG = [
    "--set",
    "runtime.world_size=2",
    "--set",
    "train.epochs=100000",
    "--set",
    "tracking.enabled=false",
]
START_S = 300  # generous: from `enn` start to both workers stepping (2 shared cores)
STOP_S = 60  # from the cancel / SIGTERM to `enn` gone


@pytest.fixture(scope="module")
def proj(tmp_path_factory, prefect_home_shared) -> Project:
    return make_project(
        tmp_path_factory.mktemp("cancel") / "proj", prefect_home_shared, stages=STAGES
    )


def start(p: Project, *args: str) -> tuple[subprocess.Popen, Path]:
    for old in (p.root / "work" / "runs").glob("*/distributed-train/heartbeats/*.json"):
        old.unlink()  # only this run's heartbeats count
    log = p.root / f"enn-{time.monotonic_ns()}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            ["enn", *args], cwd=p.root, env=p.env, stdout=f, stderr=subprocess.STDOUT
        )
    return proc, log


def wait_training(
    p: Project, proc: subprocess.Popen, log: Path
) -> tuple[Path, list[psutil.Process]]:
    """The run directory once both workers are in their training steps, and every process
    `enn` has started by then (workers, Prefect's temporary server)."""
    deadline = time.time() + START_S
    while time.time() < deadline and proc.poll() is None:
        beats = {}
        for b in (p.root / "work" / "runs").glob("*/distributed-train/heartbeats/rank-*.json"):
            try:
                beats[b] = json.loads(b.read_text())
            except (OSError, json.JSONDecodeError):
                continue  # being rewritten: read it next round
        if len(beats) == 2 and all(h["phase"] == "step" for h in beats.values()):
            run_dir = next(iter(beats)).parents[1]
            return run_dir, psutil.Process(proc.pid).children(recursive=True)
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(
        f"the workers never trained (exit {proc.poll()}):\n{log.read_text()[-4000:]}"
    )


def survivors(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for q in procs:
        try:
            # a zombie has exited (only not reaped yet, e.g. by a container's pid 1)
            if q.is_running() and q.status() != psutil.STATUS_ZOMBIE:
                out.append(q)
        except psutil.NoSuchProcess:
            continue
    return out


def assert_all_gone(procs: list[psutil.Process], enn: subprocess.Popen, log: Path) -> None:
    """`enn` exits within STOP_S, and every process it had started is gone 10 s later."""
    t0 = time.monotonic()
    try:
        enn.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        enn.kill()
        raise AssertionError(
            f"enn still running {STOP_S} s after it was stopped:\n{log.read_text()[-4000:]}"
        ) from None
    exited = time.monotonic() - t0
    end = time.time() + 10
    while survivors(procs) and time.time() < end:
        time.sleep(0.2)
    left = survivors(procs)
    print(
        f"enn exited {exited:.1f} s after the stop; its processes gone after {time.monotonic() - t0:.1f} s"
    )
    described = [f"{q.pid} {' '.join(q.cmdline())[:100]}" for q in left]
    for q in left:  # never leave a process behind, even when the test fails
        q.kill()
    assert described == [], f"processes left behind: {described}"
    assert len(procs) >= 2, f"expected the workers among enn's children, saw {procs}"


def assert_lock_free(p: Project) -> None:
    fd = os.open(p.root / "work" / "pipeline.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError if still held
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def test_cancelling_the_flow_run_ends_every_worker(proj):
    proc, log = start(proj, "run", "--until", "distributed-train", *LONG)
    run_dir, procs = wait_training(proj, proc, log)
    flow_run_id = run_dir.parent.name  # the run directory is named by the flow run id
    url = re.search(r"Starting temporary server on (http://\S+)", log.read_text())
    assert url, f"no temporary Prefect server in the log:\n{log.read_text()[-3000:]}"
    env = {**proj.env, "PREFECT_API_URL": f"{url.group(1).rstrip('/')}/api"}
    out = subprocess.run(
        ["prefect", "flow-run", "cancel", flow_run_id],
        cwd=proj.root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert_all_gone(procs, proc, log)
    text = log.read_text()
    assert proc.returncode == 130, text[-3000:]
    assert "Finished in state Cancelled(" in text  # Prefect's own record of the final state
    assert "cancelled: flow run cancelled during distributed-train" in text
    assert_lock_free(proj)


@pytest.mark.parametrize(
    "command",
    [["run", "--until", "distributed-train"], ["distributed-train"]],
    ids=["enn-run", "enn-stage"],
)
def test_sigterm_ends_every_worker_and_releases_the_lock(proj, command):
    if command[0] != "run" and not (proj.root / "outputs" / "prepare-checkpoint").is_dir():
        proj.run("enn", "run", "--until", "prepare-checkpoint", *LONG)  # when run on its own
    proc, log = start(proj, *command, *LONG)
    _, procs = wait_training(proj, proc, log)
    proc.send_signal(signal.SIGTERM)
    assert_all_gone(procs, proc, log)
    text = log.read_text()
    assert proc.returncode == 143, text[-3000:]
    assert "terminated (SIGTERM): workers stopped, lock released" in text
    assert_lock_free(proj)


def test_cancel_event_kills_prediction_workers(tmp_path):
    """predict's workers honour the stage's `ctx.cancel` the way the training launcher does."""
    import threading

    import numpy as np
    import torch

    from enn_core.config import FaultConfig
    from enn_core.errors import WorkerError
    from enn_core.predict.chunks import PartsPlan, PartStore
    from enn_core.predict.workers import WorkerJob, run

    np.save(tmp_path / "features.npy", np.zeros((40, 3), np.float32))
    plan = PartsPlan(40, 8, (3,), "float32", "m", "i")
    store = PartStore(tmp_path / "parts", plan)
    store.prepare()
    markers = tmp_path / "faults"
    hang = FaultConfig(kind="hang", phase="predict_chunk", times=2)  # both workers stall
    jobs = [
        WorkerJob(
            r,
            2,
            str(store.root),
            plan,
            str(tmp_path / "features.npy"),
            None,
            4,
            loader=torch.nn.Identity,
            fault=hang,
            fault_marker_dir=str(markers),
        )
        for r in range(2)
    ]
    cancel = threading.Event()

    def cancel_once_both_hang() -> None:
        deadline = time.time() + START_S
        while len(list(markers.glob("fault-hang-*"))) < 2 and time.time() < deadline:
            time.sleep(0.2)
        cancel.set()

    threading.Thread(target=cancel_once_both_hang, daemon=True).start()
    with pytest.raises(WorkerError, match="predict cancelled; its 2 workers were killed"):
        run(jobs, cancel=cancel)
    assert len(list(markers.glob("fault-hang-*"))) == 2, "the workers never reached their chunk"
    pids = [int(m.read_text().split()[0]) for m in markers.glob("fault-hang-*")]  # "pid rank=r"
    assert survivors([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]) == []
