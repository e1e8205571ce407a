"""A worker, or torchrun itself, killed from outside by SIGKILL, as the kernel's out-of-memory
killer kills the largest process: it raises nothing, and the launcher says so in one line,
OutOfMemory (exit code 13), from the exit signal alone (issue 51)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from enn_core.errors import OutOfMemory
from enn_core.runtime.launch import launch


def wait_to_be_killed(pid_file: str) -> None:
    """The worker: writes its pid and its parent's (torchrun's, when there is one), then
    waits to be killed."""
    Path(pid_file).write_text(f"{os.getpid()} {os.getppid()}")
    time.sleep(120)


def kill_when_written(pid_file: Path, which: int) -> threading.Thread:
    """SIGKILL to the worker (`which` 0) or its parent (1) once the pid file names them."""

    def run() -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            text = pid_file.read_text() if pid_file.exists() else ""
            if len(text.split()) == 2:
                os.kill(int(text.split()[which]), signal.SIGKILL)
                return
            time.sleep(0.05)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def gone(pid_file: Path) -> bool:
    """The worker has ended (a zombie its parent has not reaped counts as ended)."""
    pid = int(pid_file.read_text().split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(120)
def test_a_worker_killed_from_outside_is_named_as_the_oom_killer(tmp_path):
    pid_file = tmp_path / "pids"
    killer = kill_when_written(pid_file, 0)
    with pytest.raises(OutOfMemory) as e:
        launch(wait_to_be_killed, (str(pid_file),), nprocs=1, run_dir=tmp_path, hang_timeout_s=60)
    killer.join()
    assert str(e.value).startswith(
        "rank 0 was killed by signal 9 (SIGKILL, no Python error), most likely by the kernel's "
        "out-of-memory killer (`dmesg` or `journalctl -k` shows 'Out of memory: Killed process')"
    )
    assert "\n" not in str(e.value) and e.value.exit_code == 13
    assert gone(pid_file)


@pytest.mark.timeout(120)
def test_torchrun_killed_from_outside_is_named_as_the_oom_killer(tmp_path):
    """max_restarts=1 goes through torchrun's agent: it is the one killed; its worker dies
    with it (it dies with its parent)."""
    pid_file = tmp_path / "pids"
    killer = kill_when_written(pid_file, 1)
    with pytest.raises(OutOfMemory) as e:
        launch(
            wait_to_be_killed,
            (str(pid_file),),
            nprocs=1,
            run_dir=tmp_path,
            hang_timeout_s=60,
            max_restarts=1,
        )
    killer.join()
    assert str(e.value).startswith(
        "torchrun (the workers' agent) was killed by signal 9 (SIGKILL, no Python error), most "
        "likely by the kernel's out-of-memory killer"
    )
    assert "\n" not in str(e.value)
    assert gone(pid_file)  # the worker died with its agent


@pytest.mark.timeout(120)
def test_a_cancelled_launch_stops_torchrun_and_its_worker_through_the_process_table(tmp_path):
    """torchrun is a child of enn_core.runtime.children while the job runs; a cancel stops it
    and its worker (found by pid and start time), and it leaves the table."""
    from enn_core.errors import WorkerError
    from enn_core.runtime import children

    pid_file = tmp_path / "pids"
    cancel = threading.Event()
    seen: list[tuple[str, int]] = []

    def watch() -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not cancel.is_set():
            if pid_file.exists() and len(pid_file.read_text().split()) == 2:
                seen.extend((c.kind, c.pid) for c in children.running())
                cancel.set()
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with pytest.raises(WorkerError, match="cancelled; every worker was killed"):
        launch(
            wait_to_be_killed,
            (str(pid_file),),
            nprocs=1,
            run_dir=tmp_path,
            hang_timeout_s=60,
            max_restarts=1,
            cancel=cancel,
        )
    watcher.join()
    agent = int(pid_file.read_text().split()[1])
    assert ("torchrun", agent) in seen
    assert agent not in {c.pid for c in children.running()}
    assert gone(pid_file)
