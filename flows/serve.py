"""`enn serve`: MLflow's scoring server over this project's store and a registered model (this
task's champion unless `--model` names another), on loopback, until Ctrl-C.

    enn serve                       # models:/<this task's model>@champion on 127.0.0.1:5001
    enn serve --model models:/enn-synthetic/3 --port 0     # a version; a free port

It runs `mlflow models serve --env-manager local` as docs/serving.md's raw line does, with what that
line needs from the project: the tracking URI of the project's store (run from the project
root without it, MLflow opens a new `./mlflow.db` and finds no model) and the environment's
`bin/` on PATH (MLflow starts `uvicorn` by name). It prints the URL and two requests that work
as printed: a JSON body and a CSV body of the model's input example.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from enn_core.config import RunConfig
from enn_core.config.urls import redact_url
from enn_core.errors import ConfigError
from enn_core.paths import Layout
from flows.servers import free_port, local_server
from tasks.tracking.uris import client_for, use_store

DEFAULT_PORT = 5001  # beside `enn ui`'s MLflow UI on 5000


def serve_command(cfg: RunConfig, layout: Layout, model: str | None, port: int | None) -> int:
    from tasks.tracking.models import expand

    ref = expand(model or "champion", cfg, layout.root)
    tracking = cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or layout.mlflow_uri
    example = input_example(ref, tracking)
    host = cfg.deploy.host
    port = free_port(host) if port == 0 else port or DEFAULT_PORT
    check_free(host, port)
    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": tracking,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    cmd = [str(bin_dir / "mlflow"), "models", "serve", "-m", ref, "--env-manager", "local"]
    cmd += ["-h", host, "-p", str(port)]
    url = f"http://{host}:{port}"
    log = layout.work / "logs" / "mlflow-serve.log"
    print(f"starting MLflow's scoring server for {ref} (log: {log})", flush=True)
    with local_server(cmd, env, f"{url}/ping", log):
        for line in usage(ref, url, example, tracking):
            print(line, flush=True)
        while True:
            time.sleep(3600)


def check_free(host: str, port: int) -> None:
    """One line instead of the server's traceback when the port is taken."""
    import socket

    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(
                f"{host}:{port} is in use ({e.strerror}); give another with --port N "
                "(--port 0: a free one)"
            ) from e


def input_example(ref: str, tracking: str) -> dict:
    """The model's input example (`{"columns": [...], "data": [[...], ...]}`), or a one-line
    error when `ref` names no registered version."""
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    if not ref.startswith("models:/"):
        raise ConfigError(
            f"--model {ref}: enn serve serves a registered model, models:/NAME@ALIAS or "
            "models:/NAME/VERSION, not a file; `enn run` registers the model it trains "
            "(docs/serving.md)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        try:
            use_store(tracking)
            path = mlflow.artifacts.download_artifacts(f"{ref}/input_example.json", dst_path=tmp)
        except (MlflowException, OSError) as e:
            first = str(e).strip().splitlines()[0][:200]
            names = registered_names(tracking)
            hint = f"registered here: {', '.join(names)}" if names else "train first (enn run)"
            raise ConfigError(
                f"{ref}: no registered model to serve ({first}); {hint} (docs/serving.md)"
            ) from e
        return json.loads(Path(path).read_text())


def registered_names(tracking: str) -> list[str]:
    """The store's registered model names (at most 10), [] when it cannot say."""
    try:
        return sorted(m.name for m in client_for(tracking).search_registered_models())[:10]
    except Exception:  # noqa: BLE001 - only a hint in an error line already being raised
        return []


def usage(ref: str, url: str, example: dict, tracking: str) -> list[str]:
    """What `enn serve` prints once the server answers: the URL, a JSON and a CSV request of
    one example row, and the raw MLflow command it runs."""
    row = {"columns": example["columns"], "data": example["data"][:1]}
    body = json.dumps({"dataframe_split": row})
    csv = ",".join(row["columns"]) + "\\n" + ",".join(str(v) for v in row["data"][0]) + "\\n"
    post = f"curl -s -X POST {url}/invocations"
    return [
        f"serving {ref} at {url}/invocations (Ctrl-C stops)",
        f"  JSON: {post} -H 'Content-Type: application/json' -d {shlex.quote(body)}",
        f"  CSV:  printf '{csv}' | {post} -H 'Content-Type: text/csv' --data-binary @-",
        f"  the same without enn: MLFLOW_TRACKING_URI={redact_url(tracking)} mlflow models serve "
        f"-m {ref} --env-manager local -h 127.0.0.1 -p {url.rsplit(':', 1)[1]}",
    ]
