"""The servers' other users (issue 52.4, 52.6): docs/security.md's MLflow tracking server with
basic authentication (`mlflow server --app-name basic-auth`, default_permission READ), on
loopback with SQLite stores, and two users of it.

- A registered model name another user holds is found when the run starts (before any
  stage), one line naming the name and `tracking.registered_model`; before, the task trained,
  validated and predicted for minutes, then failed at export with a 403 in 281 lines.
- A wrong password is one line naming MLFLOW_TRACKING_USERNAME/PASSWORD; before, the server
  that answered 401 was said to have "not answered".
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from enn_core.config import load_config
from enn_core.errors import ConfigError
from enn_core.paths import Layout
from enn_core.stages import FLOWS
from flows.servers import free_port

pytestmark = pytest.mark.e2e

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


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory) -> Iterator[AuthServer]:
    """MLflow's basic-auth app on a loopback port, its users alice and bob."""
    where = tmp_path_factory.mktemp("mlflow-auth")
    ini = where / "auth.ini"
    ini.write_text(AUTH_INI.format(db=where / "users.db"))
    ini.chmod(0o600)
    port = free_port()
    passwords = {u: secrets.token_urlsafe(12) for u in ("admin", "alice", "bob")}
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
    log = open(where / "server.log", "w")  # noqa: SIM115 - the server's, closed below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=where)
    url = f"http://127.0.0.1:{port}"
    server = AuthServer(url, passwords)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (where / "server.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).read()  # noqa: S310
                break
            except OSError:
                assert time.monotonic() < deadline, (where / "server.log").read_text()[-3000:]
                time.sleep(0.5)
        for user in ("alice", "bob"):
            made = server.call(
                "admin", "users/create", {"username": user, "password": passwords[user]}
            )
            assert made[0] == 200, made
        yield server
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _as(monkeypatch, server: AuthServer, user: str, password: str | None = None) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password or server.passwords[user])


def test_a_model_name_another_user_holds_stops_the_run_before_training(
    auth_server, tmp_path, monkeypatch
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
            cfg, tmp_path / "params.yaml", layout, "training", specs=FLOWS["training"], spare=False
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
