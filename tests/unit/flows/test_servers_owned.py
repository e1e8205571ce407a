"""`enn ui` and `enn deploy` print a server's link only when the server answering it is
theirs: a port another process holds is one line naming the port and who holds it (it printed
the MLflow link while someone else's server answered there), and a server whose address is
answered by a process outside its own tree is stopped and named. A host other than loopback
gets docs/security.md's warning about authentication."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from enn_core.errors import ConfigError
from tests.fixtures.project import contained_env

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_server(folder: Path, port: int) -> subprocess.Popen:
    """`python -m http.server` answering `/health` with 200 from `folder`."""
    (folder / "health").write_text("ok")
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    proc = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    raise AssertionError("the stand-in server did not start")


@pytest.fixture
def squatter(tmp_path):
    """Someone else's HTTP server on a loopback port, answering /health like a real one."""
    port = free_port()
    proc = http_server(tmp_path, port)
    yield port, proc
    proc.kill()
    proc.wait()


def enn(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    (tmp_path / "params.yaml").write_text("tracking: {enabled: false}\n")
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    env = contained_env(tmp_path, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "flows.cli", *argv]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "argv",
    [
        ("ui", "--port", "{port}"),
        ("ui", "--port", "{port}", "--set", "deploy.host=0.0.0.0"),
        ("deploy", "--set", "deploy.prefect_port={port}"),
    ],
)
def test_a_port_someone_else_holds_is_one_line_naming_them(tmp_path, squatter, argv):
    port, proc = squatter
    out = enn(tmp_path, *(a.format(port=port) for a in argv))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "UI: http" not in out.stdout and "Prefect server: http" not in out.stdout
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"port {port} on " in errors[0], out.stderr
    assert f"is held by pid {proc.pid} (" in errors[0] and "http.server" in errors[0]
    exposed = "deploy.host=0.0.0.0" in argv
    warned = [line for line in out.stderr.splitlines() if "not loopback" in line]
    assert len(warned) == exposed and (not exposed or "no authentication" in warned[0])


def test_a_server_answered_by_another_process_is_stopped_and_named(tmp_path):
    """The started command's own tree never listens; a process outside it answers the health
    URL (as a server that took the port between the check and the start would)."""
    from flows.servers import start_server

    port = free_port()
    pid_file = tmp_path / "pid"
    spawn = (  # started by an intermediate that exits at once: not a descendant of `cmd`
        "import subprocess, sys; "
        f"p = subprocess.Popen([sys.executable, '-m', 'http.server', '{port}', '--bind', "
        f"'127.0.0.1'], cwd={str(tmp_path)!r}, start_new_session=True, "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))"
    )
    detached = (
        f"import subprocess, sys, time; subprocess.run([sys.executable, '-c', {spawn!r}]); "
        "time.sleep(120)"
    )
    (tmp_path / "health").write_text("ok")
    try:
        with pytest.raises(ConfigError, match=r"answers, but from pid \d+ \(.*http.server"):
            start_server(
                [sys.executable, "-c", detached],
                {},
                f"http://127.0.0.1:{port}/health",
                tmp_path / "server.log",
                timeout_s=60,
                what="the test server",
            )
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_only_loopback_is_quiet(caplog):
    from flows.servers import is_loopback, warn_if_exposed

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("example")
    with caplog.at_level("WARNING", logger="enn"):
        warn_if_exposed("127.0.0.1", "the MLflow UI")
        warn_if_exposed("0.0.0.0", "the MLflow UI")
    assert [r.getMessage()[:46] for r in caplog.records] == [
        "the MLflow UI listens on 0.0.0.0, not loopback"
    ]


def test_a_host_that_is_not_this_machine_s_is_one_line(tmp_path):
    out = enn(tmp_path, "ui", "--port", str(free_port()), "--set", "deploy.host=203.0.113.9")
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr
    assert "cannot listen on 203.0.113.9:" in errors[0] and "deploy.host" in errors[0]


def test_a_crafted_ui_file_does_not_choose_where_a_run_reports(tmp_path, squatter):
    """work/ui.json is data: `enn run` reports to the Prefect API it names only when the pid
    it names is still the process that wrote it and that process's tree holds the port."""
    import json

    import psutil

    from tasks.ui import running_ui

    port, proc = squatter
    api = f"http://127.0.0.1:{port}/api"
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "health").write_text("ok")  # the squatter answers /api/health
    started = psutil.Process(proc.pid).create_time()
    crafted = [
        {"pid": 1, "started": psutil.Process(1).create_time(), "prefect_api": api},
        {"pid": proc.pid, "started": started + 5, "prefect_api": api},  # a reused pid
        {"pid": proc.pid, "prefect_api": api},  # the old record: a live pid was enough
        {"pid": proc.pid, "started": started, "prefect_api": f"http://203.0.113.9:{port}/api"},
    ]
    for ui in crafted:
        (tmp_path / "ui.json").write_text(json.dumps({**ui, "mlflow": "http://127.0.0.1:1"}))
        assert running_ui(tmp_path) is None, ui
    real = {"pid": proc.pid, "started": started, "prefect_api": api, "mlflow": "x"}
    (tmp_path / "ui.json").write_text(json.dumps(real))
    assert running_ui(tmp_path) == real  # the squatter is the writer here: believed


def test_a_port_that_is_no_port_is_one_line(tmp_path):
    out = enn(tmp_path, "ui", "--port", "70000")
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 2 and len(errors) == 1 and "names no port (0-65535)" in errors[0]
    assert "Traceback" not in out.stderr


def test_the_temporary_api_starts_beside_the_imports_and_a_ctrl_c_then_leaves_nothing(tmp_path):
    """The temporary Prefect API starts while the flow's modules are imported (its start-up
    overlaps them); a Ctrl-C in those imports stops it: no process left, its port free.
    (That it answers afterwards: every flow run of the tiers.)"""
    from flows.servers import temporary_prefect_api

    seen: list[str] = []

    def interrupted(api: str) -> None:
        seen.append(api)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        temporary_prefect_api(tmp_path / "api.log", while_starting=interrupted)
    port = int(seen[0].rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free: nothing listens there any more


def test_a_server_is_a_child_of_the_process_table_in_a_session_of_its_own(tmp_path):
    """Started and stopped through enn_core.runtime.children: listed while it serves, in a
    session of its own; out of the table, and ended, when its block ends."""
    from enn_core.runtime import children
    from flows.servers import local_server

    port = free_port()
    (tmp_path / "health").write_text("ok")
    serve = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    cmd = [*serve, "--directory", str(tmp_path)]
    with local_server(cmd, dict(os.environ), f"http://127.0.0.1:{port}/health", tmp_path / "log"):
        (server,) = [c for c in children.running() if c.kind == "server"]
        assert os.getpgid(server.pid) == server.pid
    assert server.proc.returncode is not None
    assert server not in children.running()
