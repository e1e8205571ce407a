"""Stopping a run from outside ends every process it started, within a generous deadline.

- Ctrl-C in a terminal (the pseudo-terminal's line discipline signals the whole foreground
  process group, workers included): `enn` exits 130 within 10 s with one line, the flow run
  ends Crashed in Prefect (whose temporary API `enn` keeps in its own session), the MLflow
  runs KILLED.
- SIGKILL of `enn` itself: the kernel ends the temporary API and the workers with it.
- The flow run is cancelled through the Prefect API (`prefect flow-run cancel`, against the
  temporary server `enn run` started): the flow run ends Cancelled, `enn` exits 130.
- SIGTERM to `enn run` (Prefect's engine owns SIGTERM during a flow) and to `enn
  distributed-train` (no Prefect): exit 143 with a one-line message.
Each time: no process `enn` started is left (workers, Prefect's server), the lock is free.

One project for the module: the first `enn run` stages the data and the initial checkpoint
(DVC records them), so later runs go straight to training.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.fixtures.project import Project, make_project

pytestmark = pytest.mark.timeout(600)
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
        f"enn exited {exited:.1f} s after the stop; "
        f"its processes gone after {time.monotonic() - t0:.1f} s"
    )
    described = [f"{q.pid} {' '.join(q.cmdline())[:100]}" for q in left]
    for q in left:  # never leave a process behind, even when the test fails
        q.kill()
    assert described == [], f"processes left behind: {described}"
    assert len(procs) >= 2, f"expected the workers among enn's children, saw {procs}"


def last_message(text: str) -> str:
    """enn's closing line, which it wraps at 120 columns with later lines indented: rejoined."""
    lines = text.rstrip().splitlines()
    first = max(i for i, line in enumerate(lines) if not line.startswith("  "))
    return " ".join(line.strip() for line in lines[first:])


def start_in_terminal(p: Project, *args: str) -> tuple[subprocess.Popen, int, list[bytes]]:
    """`enn` as a terminal runs it: a session of its own whose controlling terminal is a
    pseudo-terminal, its process group in the foreground. Returns the process, the terminal's
    master end and the bytes read from it (a thread keeps reading)."""
    for old in (p.root / "work" / "runs").glob("*/distributed-train/heartbeats/*.json"):
        old.unlink()
    master, slave = pty.openpty()

    def controlling_terminal() -> None:
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        ["enn", *args],
        cwd=p.root,
        env={**p.env, "TERM": "xterm"},
        stdin=slave,
        stdout=slave,
        stderr=slave,
        preexec_fn=controlling_terminal,  # noqa: PLW1509 - setsid and the terminal, before exec
    )
    os.close(slave)
    seen: list[bytes] = []

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every process holding the terminal is gone
                return
            if not chunk:
                return
            seen.append(chunk)

    threading.Thread(target=read, daemon=True).start()
    return proc, master, seen


def prefect_flow_run_states(p: Project) -> list[str]:
    """The state of each flow run in the project's Prefect database, newest first, read
    through Prefect's client (a temporary API over the project's PREFECT_HOME)."""
    code = (
        "import asyncio\n"
        "from prefect.client.orchestration import get_client\n"
        "from prefect.client.schemas.sorting import FlowRunSort\n"
        "async def main():\n"
        "    async with get_client() as c:\n"
        "        runs = await c.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=5)\n"
        "        print(' '.join(r.state.type.value for r in runs))\n"
        "asyncio.run(main())\n"
    )
    env = {k: v for k, v in p.env.items() if k != "PREFECT_API_URL"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=p.root,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_ctrl_c_in_a_terminal_exits_130_within_10_s_and_records_the_run(proj):
    tracked = [*LONG[:4], "--set", "tracking.enabled=true"]  # MLflow on (--set persists)
    proc, master, seen = start_in_terminal(proj, "run", "--until", "distributed-train", *tracked)
    log = proj.root / "terminal.log"
    try:
        _, procs = wait_training(proj, proc, log)
        os.write(master, b"\x03")  # Ctrl-C, as a person types it
        t0 = time.monotonic()
        proc.wait(timeout=STOP_S)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        time.sleep(0.5)
        os.close(master)
        log.write_bytes(b"".join(seen))
    # what a person reads: colour and cursor codes are not text
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", log.read_text(errors="replace"))
    print(f"enn exited {took:.1f} s after Ctrl-C")
    assert proc.returncode == 130, text[-3000:]
    assert took < 10, f"{took:.1f} s from Ctrl-C to exit:\n{text[-3000:]}"
    assert "Traceback" not in text and "ConnectError" not in text, text[-3000:]
    # the terminal itself may echo "^C" just before enn's line (ECHOCTL); that is not enn's text
    assert last_message(text).removeprefix("^C") == (
        "interrupted; run the same command again to resume: DVC skips the stages that "
        "finished; distributed-train continues from its last checkpoint if it was stopped "
        "mid-training with the same data, model and train settings, else trains from epoch 1"
    ), text[-1000:]
    assert_all_gone(procs, proc, log)
    assert_lock_free(proj)
    assert prefect_flow_run_states(proj)[0] in ("CRASHED", "CANCELLED")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{proj.root / 'work' / 'mlflow' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("enn").experiment_id
    parent = client.search_runs([exp], "tags.`enn.kind` = 'pipeline'", max_results=1)[0]
    children = client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    status = {r.info.run_name: r.info.status for r in children}
    assert parent.info.status == "KILLED" and status["distributed-train"] == "KILLED", status


def listening(procs: list[psutil.Process]) -> list[str]:
    """Every listening TCP address of these processes, as ip:port."""
    out = []
    for q in procs:
        with contextlib.suppress(psutil.Error):
            for c in q.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.append(f"{c.laddr.ip}:{c.laddr.port} ({q.pid} {q.name()})")
    return out


def test_sigkill_of_enn_leaves_no_process_and_nothing_listened_beyond_loopback(proj):
    proc, log = start(proj, "run", "--until", "distributed-train", *LONG)
    _, procs = wait_training(proj, proc, log)
    assert any("uvicorn" in " ".join(q.cmdline()) for q in procs), "no temporary Prefect API"
    # the rendezvous store, the workers' store, the workers' gloo sockets, Prefect's API
    sockets = listening([psutil.Process(proc.pid), *procs])
    assert len(sockets) >= 3, sockets
    assert [a for a in sockets if not a.startswith("127.0.0.1:")] == [], sockets
    proc.kill()
    proc.wait(timeout=STOP_S)
    end = time.time() + 10
    while survivors(procs) and time.time() < end:
        time.sleep(0.2)
    left = [f"{q.pid} {' '.join(q.cmdline())[:100]}" for q in survivors(procs)]
    for q in survivors(procs):
        q.kill()
    assert left == [], f"processes left behind after SIGKILL of enn: {left}"


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
    url = re.search(r"Prefect API: (http://\S+) \(temporary", log.read_text())
    assert url, f"no temporary Prefect API in the log:\n{log.read_text()[-3000:]}"
    env = {**proj.env, "PREFECT_API_URL": url.group(1)}
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
    # Prefect's own record of the final state, in the run's log file (not on the console)
    logs = sorted((proj.root / "work" / "logs").glob("*-run-training.log"))
    assert "Finished in state Cancelled(" in logs[-1].read_text()
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
    """predict's launched ranks honour the stage's `ctx.cancel` the way training's do."""
    import threading

    import numpy as np

    from enn_core.config import FaultConfig
    from enn_core.errors import WorkerError
    from enn_core.predict.chunks import PartsPlan
    from enn_core.predict.ranks import Limits, RankJob, launch_ranks
    from enn_core.predict.workers import Loader, WorkerJob
    from enn_core.runtime.network import InterfaceChoice
    from tests.fixtures.predict import job_secret, parts_store

    np.save(tmp_path / "features.npy", np.zeros((40, 3), np.float32))
    plan = PartsPlan(40, 8, (3,), "float32", "m", "i")
    store = parts_store(tmp_path / "parts", plan, tmp_path)
    store.prepare()
    markers = tmp_path / "faults"
    hang = FaultConfig(kind="hang", phase="predict_chunk", times=2)  # both workers stall
    job = WorkerJob(
        0,
        2,
        str(store.root),
        plan,
        str(tmp_path / "features.npy"),
        None,
        4,
        loader=Loader("torch.nn:Identity"),
        fault=hang,
        fault_marker_dir=str(markers),
        secret_file=job_secret(tmp_path),
    )
    spec = RankJob(job, str(tmp_path / "run"), InterfaceChoice("lo", "one node"), 600.0, "cpu")
    cancel = threading.Event()

    def cancel_once_both_hang() -> None:
        deadline = time.time() + START_S
        while len(list(markers.glob("fault-hang-*"))) < 2 and time.time() < deadline:
            time.sleep(0.2)
        cancel.set()

    threading.Thread(target=cancel_once_both_hang, daemon=True).start()
    with pytest.raises(WorkerError, match="predict cancelled; its 2 workers were killed"):
        launch_ranks(spec, 2, Limits(600.0, 300.0, 600.0), cancel=cancel)
    assert len(list(markers.glob("fault-hang-*"))) == 2, "the workers never reached their chunk"
    pids = [int(m.read_text().split()[0]) for m in markers.glob("fault-hang-*")]  # "pid rank=r"
    assert survivors([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]) == []
