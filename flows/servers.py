"""Local servers on loopback: `prefect server start` (for schedules) and `mlflow server`
(the UI). Each runs in its own process session and is stopped with its whole process group,
so nothing is orphaned (FIELD_NOTES: a SIGKILLed parent otherwise leaves children behind)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from enn_core.errors import TransientError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise TransientError(
                f"server exited with {proc.returncode} before answering {url}; log: {log}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 - loopback only
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TransientError(f"{url} did not answer within {timeout:.0f} s; log: {log}")


def stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace)


@contextlib.contextmanager
def local_server(cmd: list[str], env: dict[str, str], health_url: str, log: Path) -> Iterator[None]:
    """Run `cmd` in its own process session, wait until `health_url` answers, stop the group."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        wait_http(health_url, 180, proc, log)
        yield
    finally:
        stop_group(proc)


@contextlib.contextmanager
def prefect_server(host: str, port: int, log: Path, scheduler_loop_s: float = 5.0) -> Iterator[str]:
    """`prefect server start` on host:port; yields its API URL."""
    port = port or free_port(host)
    env = {
        **os.environ,
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": str(scheduler_loop_s),
        "PREFECT_UI_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    exe = Path(sys.executable).parent / "prefect"
    api = f"http://{host}:{port}/api"
    with local_server(
        [str(exe), "server", "start", "--host", host, "--port", str(port)],
        env,
        f"{api}/health",
        log,
    ):
        yield api


def mlflow_server_command(tracking_uri: str, artifacts: Path, host: str, port: int) -> list[str]:
    exe = Path(sys.executable).parent / "mlflow"
    return [
        str(exe),
        "server",
        "--backend-store-uri",
        tracking_uri,
        "--artifacts-destination",
        str(artifacts),
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
    ]


@contextlib.contextmanager
def mlflow_server(
    tracking_uri: str, artifacts: Path, host: str, port: int, log: Path
) -> Iterator[str]:
    """`mlflow server` over the project's store, job execution off (490 MB instead of 1.6 GB)."""
    port = port or free_port(host)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    url = f"http://{host}:{port}"
    with local_server(
        mlflow_server_command(tracking_uri, artifacts, host, port), env, f"{url}/health", log
    ):
        yield url
