"""The servers' other users (issue 52.4, 52.6): docs/security.md's MLflow tracking server with
basic authentication (`mlflow server --app-name basic-auth`, default_permission READ), on
loopback with SQLite stores, and two users of it.

- A registered model name another user holds is found when the run starts (before any
  stage), one line naming the name and `tracking.registered_model`; before, the task trained,
  validated and predicted for minutes, then failed at export with a 403 in 281 lines.
- A wrong password is one line naming MLFLOW_TRACKING_USERNAME/PASSWORD; before, the server
  that answered 401 was said to have "not answered".
- Prefect's API with an auth string (as `enn run` starts it, PREFECT_SERVER_API_AUTH_STRING):
  a wrong PREFECT_API_AUTH_STRING is one line naming it; before, a 67-line traceback.
- PostgreSQL (a study's storage) refusing the login is one line naming PGPASSWORD; before, it
  "cannot be reached".

The three servers start at once in one module fixture (their start-ups overlap).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from enn_core.config import load_config
from enn_core.errors import ConfigError
from enn_core.paths import Layout
from enn_core.runtime.children import term_when_parent_dies
from enn_core.stages import FLOWS
from flows.servers import free_port
from tests.fixtures.postgres import bindir, missing
from tests.fixtures.project import ROOT, clean_env

pytestmark = pytest.mark.e2e

PG_PASSWORD = secrets.token_hex(12)
PG_PREFIX = "enn-test-users-pg-"
AUTH_INI = """[mlflow]
default_permission = READ
database_uri = sqlite:///{db}
admin_username = admin
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
"""


@dataclass(frozen=True)
class AuthServer:
    url: str
    passwords: dict[str, str]

    def call(self, user: str, api: str, body: dict) -> tuple[int, dict]:
        """POST `body` to `api` as `user`; (status, answer)."""
        token = base64.b64encode(f"{user}:{self.passwords[user]}".encode()).decode()
        req = urllib.request.Request(
            f"{self.url}/api/2.0/mlflow/{api}",
            json.dumps(body).encode(),
            {"Content-Type": "application/json", "Authorization": f"Basic {token}"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 - loopback
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, {"body": e.read().decode(errors="replace")}


def _start_mlflow(where: Path, passwords: dict[str, str]) -> tuple[str, subprocess.Popen]:
    ini = where / "auth.ini"
    ini.write_text(AUTH_INI.format(db=where / "users.db"))
    ini.chmod(0o600)
    port = free_port()
    env = {
        **os.environ,
        "MLFLOW_AUTH_CONFIG_PATH": str(ini),
        "MLFLOW_AUTH_ADMIN_PASSWORD": passwords["admin"],
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    exe = Path(sys.executable).parent / "mlflow"
    cmd = [str(exe), "server", "--app-name", "basic-auth", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--workers", "1"]
    cmd += ["--backend-store-uri", f"sqlite:///{where / 'mlflow.db'}"]
    cmd += ["--artifacts-destination", str(where / "artifacts")]
    return f"http://127.0.0.1:{port}", _spawn(cmd, env, where / "mlflow.log")


def _start_prefect(where: Path, auth: str) -> tuple[str, subprocess.Popen]:
    """Prefect's API as `enn run` starts it (flows.servers), with an API auth string."""
    code = (
        "import sys, time; from pathlib import Path; from flows.servers import "
        "temporary_prefect_api as t; print(t(Path(sys.argv[1]), 180), flush=True); time.sleep(3600)"
    )
    env = clean_env(
        PREFECT_SERVER_API_AUTH_STRING=auth,
        PREFECT_API_AUTH_STRING=auth,
        PREFECT_HOME=str(where / "prefect-home"),
        PYTHONPATH=str(ROOT),
    )
    out = where / "prefect.out"
    proc = _spawn([sys.executable, "-c", code, str(where / "prefect.log")], env, out)
    return "", proc


def _start_postgres(where: Path) -> tuple[str, subprocess.Popen | None]:
    """A PostgreSQL on loopback (password logins), as tests/fixtures/postgres.py makes one."""
    if missing() is not None or os.geteuid() != 0:
        return "", None
    bins = bindir()
    assert bins is not None
    _sweep_postgres()
    folder = Path(tempfile.mkdtemp(prefix=PG_PREFIX))  # postgres must reach it: not under 0700
    (folder / "owner").write_text(str(os.getpid()))
    folder.chmod(0o755)
    shutil.chown(folder, "postgres", "postgres")
    pwfile = folder / "pwfile"
    pwfile.write_text(PG_PASSWORD + "\n")
    shutil.chown(pwfile, "postgres", "postgres")
    port = free_port()
    data = folder / "data"
    as_pg = ["runuser", "-u", "postgres", "--"]
    init = [str(bins / "initdb"), "-D", str(data), "-U", "enn", "--auth-local=trust"]
    init += ["--auth-host=scram-sha-256", f"--pwfile={pwfile}", "--locale=C"]
    start = [str(bins / "pg_ctl"), "-D", str(data), "-l", str(folder / "server.log"), "-w"]
    start += ["-o", f"-p {port} -k {data} -c listen_addresses=127.0.0.1", "start"]
    script = f"{shlex.join(as_pg + init)} >/dev/null && {shlex.join(as_pg + start)} >/dev/null"
    proc = _spawn(["bash", "-c", script], dict(os.environ), where / "postgres.log")
    (where / "postgres.folder").write_text(str(folder))
    return f"postgresql://enn@127.0.0.1:{port}/postgres", proc


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A server in its own session that the kernel stops when this process dies."""
    with open(log, "w") as out:
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=term_when_parent_dies,  # noqa: PLW1509 - prctl only, before exec
        )


def _stop_postgres(folder: Path) -> None:
    bins = bindir()
    if bins is not None and (folder / "data" / "postmaster.pid").exists():
        stop = [str(bins / "pg_ctl"), "-D", str(folder / "data"), "-m", "immediate", "stop"]
        subprocess.run(["runuser", "-u", "postgres", "--", *stop], capture_output=True)
    shutil.rmtree(folder, ignore_errors=True)


def _sweep_postgres() -> None:
    """PostgreSQL detaches from pg_ctl: one a killed session left (its owner gone) is stopped."""
    for folder in Path(tempfile.gettempdir()).glob(f"{PG_PREFIX}*"):
        try:
            owner = int((folder / "owner").read_text())
            os.kill(owner, 0)
        except (OSError, ValueError):
            _stop_postgres(folder)


def _wait(what: str, ready: Callable[[], bool], proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 180
    while not ready():
        assert time.monotonic() < deadline, f"{what} did not start:\n{log.read_text()[-3000:]}"
        assert proc.poll() in (None, 0), f"{what} failed:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2).read()  # noqa: S310 - loopback
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class Servers:
    mlflow: AuthServer
    prefect_api: str
    prefect_auth: str
    postgres: str  # '' where this machine cannot make one


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[Servers]:
    """The three servers with users, started at once (their start-ups overlap)."""
    where = tmp_path_factory.mktemp("servers")
    passwords = {u: secrets.token_urlsafe(12) for u in ("admin", "alice", "bob")}
    auth = f"enn:{secrets.token_urlsafe(12)}"
    mlflow_url, mlflow = _start_mlflow(where, passwords)
    _, prefect = _start_prefect(where, auth)
    pg_url, postgres = _start_postgres(where)
    procs = [p for p in (mlflow, prefect, postgres) if p is not None]
    try:
        _wait(
            "mlflow server", lambda: _answers(f"{mlflow_url}/health"), mlflow, where / "mlflow.log"
        )
        server = AuthServer(mlflow_url, passwords)
        for user in ("alice", "bob"):
            made = server.call(
                "admin", "users/create", {"username": user, "password": passwords[user]}
            )
            assert made[0] == 200, made
        out = where / "prefect.out"
        _wait("Prefect API", lambda: "/api" in out.read_text(), prefect, out)
        api = out.read_text().strip().splitlines()[-1]
        if postgres is not None:
            _wait(
                "PostgreSQL", lambda: postgres.poll() is not None, postgres, where / "postgres.log"
            )
        yield Servers(server, api, auth, pg_url)
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        if (where / "postgres.folder").exists():
            _stop_postgres(Path((where / "postgres.folder").read_text()))


@pytest.fixture
def auth_server(servers) -> AuthServer:
    return servers.mlflow


@pytest.fixture
def registry_elsewhere(tmp_path) -> Iterator[None]:
    """MLflow's process-wide registry URI left on another store, as an earlier caller in the
    same process (a notebook, another test) leaves it: before, the name check and `models:/`
    lookups went there (CI: a model "free" on the server, a wrong password that downloaded)."""
    import mlflow

    mlflow.set_registry_uri(f"sqlite:///{tmp_path / 'elsewhere.db'}")
    yield
    mlflow.set_registry_uri(None)


def _as(monkeypatch, server: AuthServer, user: str, password: str | None = None) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password or server.passwords[user])


def test_a_model_name_another_user_holds_stops_the_run_before_training(
    auth_server, tmp_path, monkeypatch, registry_elsewhere
):
    from tasks.session import pipeline_session

    status, made = auth_server.call("bob", "registered-models/create", {"name": "enn-synthetic"})
    assert status == 200, made  # any user may register a name the task will use
    _as(monkeypatch, auth_server, "alice")
    (tmp_path / "params.yaml").write_text("{}\n")
    cfg = load_config(None, [f"tracking.uri={auth_server.url}"])
    layout = Layout.for_root(tmp_path)
    t0 = time.monotonic()
    with (
        pytest.raises(ConfigError) as e,
        pipeline_session(
            cfg, tmp_path / "params.yaml", layout, "training", specs=FLOWS["training"]
        ),
    ):
        raise AssertionError("the session opened: the stages would have run")
    assert time.monotonic() - t0 < 60
    msg = str(e.value)
    assert "\n" not in msg and "'enn-synthetic'" in msg and "tracking.registered_model" in msg
    assert "another user" in msg
    # a name nobody holds passes, and so does one this user holds
    own = load_config(None, [f"tracking.uri={auth_server.url}", "tracking.registered_model=a1"])
    status, _ = auth_server.call("alice", "registered-models/create", {"name": "a1"})
    assert status == 200
    from tasks.tracking import Tracker

    tracker = Tracker(own, layout)
    tracker.check_model_name(own, FLOWS["training"])
    free = load_config(None, [f"tracking.uri={auth_server.url}", "tracking.registered_model=new"])
    tracker.check_model_name(free, FLOWS["training"])


def test_a_wrong_mlflow_password_is_one_line_naming_the_variables(
    auth_server, tmp_path, monkeypatch
):
    from tasks.tracking import Tracker

    _as(monkeypatch, auth_server, "alice", "not-alices-password")
    (tmp_path / "params.yaml").write_text("{}\n")
    cfg = load_config(None, [f"tracking.uri={auth_server.url}"])
    with pytest.raises(ConfigError) as e:
        Tracker(cfg, Layout.for_root(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and "did not answer" not in msg and "401" in msg
    assert "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD" in msg
    assert "not-alices-password" not in msg


def test_a_wrong_prefect_auth_string_is_one_line_naming_it(servers, tmp_path):
    """Before: a 67-line traceback (PrefectHTTPStatusError, 401 on /api/admin/version)."""
    env = clean_env(
        PREFECT_API_URL=servers.prefect_api,
        PREFECT_API_AUTH_STRING="enn:not-the-password",
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PYTHONPATH=str(ROOT),
    )
    (tmp_path / "params.yaml").write_text("tracking: {enabled: false}\n")
    out = subprocess.run(
        [str(Path(sys.executable).parent / "enn"), "run", "--until", "stage-data"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "not-the-password" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the Prefect API at {servers.prefect_api} refused this client")
    assert "PREFECT_API_AUTH_STRING" in last and "401" in last


def test_a_wrong_or_missing_postgres_password_is_one_line_naming_pgpassword(servers, monkeypatch):
    """Before: "the study storage cannot be reached ... check that the database server runs"
    for a server that answered and refused the login."""
    if not servers.postgres:
        pytest.skip(missing() or "PostgreSQL runs as the postgres user: needs root")
    from tasks.tuning.store import check_storage

    monkeypatch.setenv("PGPASSWORD", PG_PASSWORD)
    check_storage(servers.postgres)  # the right one: an empty database passes
    for wrong in ("not-the-password", None):
        if wrong is None:
            monkeypatch.delenv("PGPASSWORD")
            monkeypatch.setenv("PGPASSFILE", "/nonexistent")
        else:
            monkeypatch.setenv("PGPASSWORD", wrong)
        with pytest.raises(ConfigError) as e:
            check_storage(servers.postgres)
        msg = str(e.value)
        assert "\n" not in msg and "refused the login" in msg and "PGPASSWORD" in msg, msg
        assert "cannot be reached" not in msg


def test_a_wrong_mlflow_password_for_a_registered_model_is_the_same_line(
    auth_server, tmp_path, monkeypatch, registry_elsewhere
):
    """`enn predict --model models:/...` from the server: before, "no such registered model
    version" for a server that answered 401."""
    from tasks.tracking.models import resolve_model_uri

    _as(monkeypatch, auth_server, "alice", "not-alices-password")
    with pytest.raises(ConfigError) as e:
        resolve_model_uri("models:/enn-synthetic@champion", tmp_path, auth_server.url)
    msg = str(e.value)
    assert "\n" not in msg and "no such registered model" not in msg and "401" in msg
    assert "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD" in msg
