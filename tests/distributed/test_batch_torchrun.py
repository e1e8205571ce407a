"""flows.torchrun, torchrun as deploy/slurm/train.sbatch runs it: a job stopped by the
scheduler's SIGTERM or SIGUSR2 ends with exit 12 ("preempted: resume me") and one line, with
torchrun's traceback in its log file and not on the job's output; a failed worker is one line
naming its rank and exit code. Real torchrun, a real worker process, real signals."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

WORKER = """
import signal, sys, time
from pathlib import Path
def saved(sig, frame):
    Path(sys.argv[1]).write_text("saved")   # what a worker's save would be
    sys.exit(12)
signal.signal(signal.SIGTERM, saved)
signal.signal(signal.SIGUSR2, saved)
if sys.argv[2] == "fail":
    sys.exit(3)
Path(sys.argv[1] + ".up").write_text("up")
time.sleep(120)
"""


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path, Path]:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    log, marker = tmp_path / "logs" / "torchrun-a0-{host}.log", tmp_path / "saved"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.torchrun",
            f"--log={log}",
            "--standalone",
            "--nproc-per-node=1",
            "--max-restarts=0",
            "--monitor-interval=0.1",
            "--signals-to-handle=SIGTERM,SIGINT,SIGUSR2",
            "--shutdown-timeout=20",
            str(worker),
            str(marker),
            mode,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        start_new_session=True,
    )
    return proc, marker, tmp_path / "logs"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2])
def test_a_signal_that_tells_the_workers_to_save_ends_with_12_and_one_line(tmp_path, sig):
    proc, marker, logs = _start(tmp_path, "wait")
    deadline = time.monotonic() + 60
    while not Path(f"{marker}.up").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    os.kill(proc.pid, sig)  # what srun forwards to torchrun on every node
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 12, err
    assert marker.read_text() == "saved"  # the worker got the signal and saved
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"torchrun: {sig.name}: forwarded"), err
    assert "exit 12: preempted, resume me" in lines[0] and "Traceback" not in out + err
    (log,) = logs.glob("torchrun-a0-*.log")
    assert "Traceback" in log.read_text() and sig.name in log.read_text()


def test_a_failed_worker_is_one_line_naming_its_rank_and_exit_code(tmp_path):
    proc, _, logs = _start(tmp_path, "fail")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [
        f"torchrun: workers failed (rank 0 exit 3); torchrun's log: {next(logs.glob('*.log'))}"
    ], err


def test_a_link_planted_where_its_log_goes_is_one_line_and_its_target_unchanged(tmp_path):
    """The log folder is on the shared file system ($ENN_SHARED/.enn-jobs/<job>/logs): a link
    planted there never makes the job append to another file."""
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / f"torchrun-a0-{socket.gethostname()}.log").symlink_to(victim)
    proc, _, _ = _start(tmp_path, "fail")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err  # DataError
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "is a link or not a plain file" in lines[0], err
    assert victim.read_text() == "mine\n"
