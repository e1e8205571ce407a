"""Where this project's UIs answer, and a run's page in them.

- `enn ui` (flows/commands.py) writes `work/ui.json` while it serves the MLflow and Prefect UIs
  (`announce_ui`); `enn run` reports its flow run to that Prefect server (`running_ui`).
- `mlflow_ui`: the MLflow UI that shows this project's runs: the tracking server (a
  `tracking.uri` over http serves the UI), else the one `enn ui` serves, else None.
- `mlflow_run_url`: a run's page there (the Prefect artifacts and the closing summary link it).
"""

from __future__ import annotations

import atexit
import json
import os
import urllib.parse
import urllib.request
from pathlib import Path

import psutil

from enn_core.atomic import write_json
from enn_core.config import RunConfig

LOOPBACK = ("127.0.0.1", "localhost", "::1")
UI_FILE = "ui.json"  # under work/: the servers `enn ui` runs, for `enn run` to report to


def announce_ui(work: Path, prefect_api: str, mlflow_url: str) -> Path:
    """Write work/ui.json while `enn ui` runs (removed when it stops)."""
    path = work / UI_FILE
    me = psutil.Process()
    write_json(
        path,
        {
            "pid": me.pid,
            "started": me.create_time(),
            "prefect_api": prefect_api,
            "mlflow": mlflow_url,
        },
    )
    atexit.register(lambda: path.unlink(missing_ok=True))
    return path


def running_ui(work: Path) -> dict[str, str] | None:
    """The servers of an `enn ui` running over this work directory, else None. The file is
    data: it is believed only when its Prefect API is on loopback and that port is held by
    the process tree of the pid it names (a crafted file must not send a run's records to a
    server of its choosing): its pid must still be the process of this user that wrote it
    (start time) and that port held by its process tree."""
    path = work / UI_FILE
    try:
        ui = json.loads(path.read_text())
        api = urllib.parse.urlparse(str(ui["prefect_api"]))
        if api.scheme != "http" or api.hostname not in LOOPBACK or not api.port:
            return None
        if not is_writer(int(ui["pid"]), float(ui["started"])):
            return None
        if not tree_listens(int(ui["pid"]), api.port):
            return None
        with urllib.request.urlopen(f"{ui['prefect_api']}/health", timeout=3) as r:  # noqa: S310
            return ui if r.status == 200 else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def is_writer(pid: int, started: float) -> bool:
    """Whether `pid` still is the process of this user that started at `started` (the one that
    wrote the file: pids are reused)."""
    try:
        p = psutil.Process(pid)
        return pid > 1 and abs(p.create_time() - started) <= 0.01 and p.uids().real == os.getuid()
    except psutil.Error:
        return False


def tree_listens(pid: int, port: int) -> bool:
    """Whether process `pid` or one of its descendants listens on `port`."""
    try:
        top = psutil.Process(pid)
        tree = [top, *top.children(recursive=True)]
    except psutil.Error:
        return False
    for p in tree:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
            return True
    return False


def mlflow_ui(cfg: RunConfig, work: Path) -> str | None:
    """The MLflow UI over this project's runs: the tracking server, or `enn ui`'s; None when
    none is known to serve them."""
    if cfg.tracking.uri.startswith(("http://", "https://")):
        return cfg.tracking.uri.rstrip("/")
    ui = running_ui(work)
    return ui["mlflow"].rstrip("/") if ui is not None and ui.get("mlflow") else None


# MLflow's model-training view; without it the UI opens its GenAI view (a per-browser setting)
ML_VIEW = "workflowType=machine_learning"


def mlflow_run_url(base: str, experiment_id: str, run_id: str) -> str:
    """`http://127.0.0.1:5000/#/experiments/1/runs/<run id>?workflowType=machine_learning`:
    the run's page in the UI, in the model-training view as the experiment's link is
    (issue 54: the run links opened MLflow's GenAI layout)."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{ML_VIEW}"
