"""Local servers on loopback: Prefect's temporary API for `enn run`, `prefect server start` (for
schedules) and `mlflow server` (the UI).

Each is a child of the process table (enn_core.runtime.children) in its own process session:
Ctrl-C in a terminal signals the whole foreground process group, and a server in that group
would die with the first SIGINT while `enn` still needs it to record the interrupted run
(FIELD_NOTES). The kernel stops each with its parent (`PR_SET_PDEATHSIG`, a foreign child of
the table), so a SIGKILLed `enn` leaves no server behind, and `stop_server` ends the whole
group (SIGTERM, STOP_GRACE_S, then SIGKILL) when `enn` exits normally.

A server's link is printed only once it is known to be this server's: its port must be free
before it starts, and after it answers, the port must be held by its own process tree (another
server answering the same address, one that grabbed the port meanwhile, would otherwise get
the runs and the clicks); else one line names the port and who holds it. A host other than
loopback is warned about: neither server authenticates anyone (docs/security.md)."""

from __future__ import annotations

import atexit
import contextlib
import errno
import importlib.util
import ipaddress
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlparse

import psutil

from enn_core.errors import ConfigError, TransientError
from enn_core.runtime import children
from tasks.ui import tree_listens

logger = logging.getLogger("enn.servers")
STOP_GRACE_S = 10.0  # a server told to stop (SIGTERM to its group) leaves within this


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


def stop_server(server: children.Child) -> None:
    """Its whole process group stopped: SIGTERM, STOP_GRACE_S to leave, then SIGKILL."""
    children.stop(server, grace_s=STOP_GRACE_S)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def warn_if_exposed(host: str, what: str) -> None:
    """docs/security.md's warning, when `host` is not loopback: nothing authenticates."""
    if not is_loopback(host):
        logger.warning(
            "%s listens on %s, not loopback: anyone who reaches this machine can use it, with "
            "no authentication; put authentication in front (mlflow server --app-name "
            "basic-auth, or a reverse proxy with TLS and auth) before exposing it "
            "(docs/security.md), or set deploy.host=127.0.0.1",
            what,
            host,
        )


def holder(port: int) -> str:
    """Who listens on `port`: 'pid N (command)', or what can be said without permission."""
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            if conn.pid is None:
                return "a process of another user"
            try:
                cmd = " ".join(psutil.Process(conn.pid).cmdline())[:120]
            except psutil.Error:
                cmd = "?"
            return f"pid {conn.pid} ({cmd})"
    return "another process"


def check_port_free(host: str, port: int, what: str) -> None:
    """Refuse to start on a port something already listens on (naming it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:  # not this machine's address, or no such host
                raise ConfigError(
                    f"{what}: cannot listen on {host}:{port} ({e.strerror or e}); set deploy.host "
                    "to an address of this machine (127.0.0.1 for this machine only)"
                ) from None
            raise ConfigError(
                f"{what}: port {port} on {host} is held by {holder(port)} ({e.strerror}); stop "
                "it or choose another port"
            ) from None


def serves(server: children.Child, port: int) -> bool:
    """Whether `server` or one of its descendants listens on `port`."""
    return tree_listens(server.pid, port)


def start_server(
    cmd: list[str],
    env: dict[str, str],
    health_url: str,
    log: Path,
    timeout_s: float = 180,
    what: str = "server",
) -> children.Child:
    """Run `cmd` in its own process session and wait until `health_url` answers, from this
    server (`serves`): its port must be free first, and its own afterwards."""
    server = launch_server(cmd, env, health_url, log, what)
    await_server(server, health_url, log, timeout_s, what)
    return server


def launch_server(
    cmd: list[str],
    env: dict[str, str],
    health_url: str,
    log: Path,
    what: str = "server",
    kind: str = "server",
) -> children.Child:
    """`start_server`'s first half: the port checked free, `cmd` started in its own session,
    a foreign child of the process table; it is not waited for (`await_server`)."""
    url = urlparse(health_url)
    try:
        host, port = url.hostname or "127.0.0.1", url.port or 80
    except ValueError:  # `enn ui --port 70000`
        raise ConfigError(f"{what}: {health_url} names no port (0-65535); choose one") from None
    check_port_free(host, port, what)
    log.parent.mkdir(parents=True, exist_ok=True)
    return children.start(kind, cmd, env=env, log=log, session=True, foreign=True)


def await_server(
    server: children.Child, health_url: str, log: Path, timeout_s: float, what: str = "server"
) -> None:
    """`start_server`'s second half: until `health_url` answers from `server` (its process
    group is stopped when it does not)."""
    port = urlparse(health_url).port or 80
    try:
        wait_http(health_url, timeout_s, server.proc, log)
        if not serves(server, port):
            raise ConfigError(
                f"{what}: {health_url} answers, but from {holder(port)}, not the server enn "
                f"started (port {port} was taken meanwhile); stop it or choose another port"
            )
    except BaseException:
        stop_server(server)
        raise


@contextlib.contextmanager
def local_server(
    cmd: list[str],
    env: dict[str, str],
    health_url: str,
    log: Path,
    timeout_s: float = 180,
    what: str = "server",
) -> Iterator[None]:
    """`start_server`, stopping its whole process group when the block ends."""
    server = start_server(cmd, env, health_url, log, timeout_s, what)
    try:
        yield
    finally:
        stop_server(server)


def temporary_prefect_api(
    log: Path, timeout_s: float = 120.0, while_starting: Callable[[str], object] | None = None
) -> str:
    """The API Prefect's own temporary mode serves (its app factory, UI off, ephemeral), on a
    free loopback port in its own session; returns its URL. Prefect would start the same
    server as a child in enn's process group, where a terminal's Ctrl-C kills it mid-run.

    It lives until this process exits: Prefect sends its last logs and events from its
    exit hooks (threading's, which run before atexit's), then the atexit hook registered
    here stops the server; the kernel stops it if this process is killed. `while_starting(api)`
    runs while the server starts (the caller's imports: the server's start-up, seconds of
    imports and its database's migrations, overlaps them on another core)."""
    spec = importlib.util.find_spec("prefect")
    assert spec is not None and spec.origin is not None, "prefect is a dependency"
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
    }
    env.pop("PREFECT_API_URL", None)
    cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        str(Path(spec.origin).parent.parent),
        "--factory",
        "prefect.server.api.server:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "on",
    ]
    api = f"http://127.0.0.1:{port}/api"
    what = "Prefect's temporary API"
    server = launch_server(cmd, env, f"{api}/health", log, what, kind="prefect-api")
    atexit.register(stop_server, server)  # from its start: an interrupted start-up stops it too
    try:
        if while_starting is not None:
            while_starting(api)
    except BaseException:
        stop_server(server)
        raise
    await_server(server, f"{api}/health", log, timeout_s, what)
    return api


@contextlib.contextmanager
def prefect_server(host: str, port: int, log: Path, scheduler_loop_s: float = 5.0) -> Iterator[str]:
    """`prefect server start` on host:port, its UI on (the links it prints work); yields its
    API URL (the UI is the same address without `/api`)."""
    port = port or free_port(host)
    env = {
        **os.environ,
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": str(scheduler_loop_s),
        "PREFECT_UI_ENABLED": "true",
        "PREFECT_UI_API_URL": f"http://{host}:{port}/api",
        "PREFECT_CLI_PROMPT": "false",  # on a terminal it would ask to write a profile
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    exe = Path(sys.executable).parent / "prefect"
    api = f"http://{host}:{port}/api"
    what = "the Prefect server (deploy.prefect_port)"
    warn_if_exposed(host, what)
    with local_server(
        [str(exe), "server", "start", "--host", host, "--port", str(port)],
        env,
        f"{api}/health",
        log,
        what=what,
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
    env = {
        **os.environ,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    url = f"http://{host}:{port}"
    what = "the MLflow UI (deploy.mlflow_port, or enn ui --port)"
    warn_if_exposed(host, what)
    with local_server(
        mlflow_server_command(tracking_uri, artifacts, host, port),
        env,
        f"{url}/health",
        log,
        what=what,
    ):
        yield url
