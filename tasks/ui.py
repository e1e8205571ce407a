"""Where this project's UIs answer, and a run's page in them.

- `enn ui` (flows/cli.py) writes `work/ui.json` while it serves the MLflow and Prefect UIs
  (`announce_ui`); `enn run` reports its flow run to that Prefect server (`running_ui`).
- `mlflow_ui`: the MLflow UI that shows this project's runs: the tracking server (a
  `tracking.uri` over http serves the UI), else the one `enn ui` serves, else None.
- `mlflow_run_url`: a run's page there (the Prefect artifacts and the closing summary link it).
"""

from __future__ import annotations

import atexit
import json
import os
import urllib.request
from pathlib import Path

from enn_core.config import RunConfig

UI_FILE = "ui.json"  # under work/: the servers `enn ui` runs, for `enn run` to report to


def announce_ui(work: Path, prefect_api: str, mlflow_url: str) -> Path:
    """Write work/ui.json while `enn ui` runs (removed when it stops)."""
    path = work / UI_FILE
    path.write_text(
        json.dumps({"pid": os.getpid(), "prefect_api": prefect_api, "mlflow": mlflow_url}) + "\n"
    )
    atexit.register(lambda: path.unlink(missing_ok=True))
    return path


def running_ui(work: Path) -> dict[str, str] | None:
    """The servers of an `enn ui` running over this work directory (its process alive and its
    Prefect API answering), else None."""
    path = work / UI_FILE
    try:
        ui = json.loads(path.read_text())
        os.kill(int(ui["pid"]), 0)
        with urllib.request.urlopen(f"{ui['prefect_api']}/health", timeout=3) as r:  # noqa: S310
            return ui if r.status == 200 else None
    except (OSError, ValueError, KeyError):
        return None


def mlflow_ui(cfg: RunConfig, work: Path) -> str | None:
    """The MLflow UI over this project's runs: the tracking server, or `enn ui`'s; None when
    none is known to serve them."""
    if cfg.tracking.uri.startswith(("http://", "https://")):
        return cfg.tracking.uri.rstrip("/")
    ui = running_ui(work)
    return ui["mlflow"].rstrip("/") if ui is not None and ui.get("mlflow") else None


def mlflow_run_url(base: str, experiment_id: str, run_id: str) -> str:
    """`http://127.0.0.1:5000/#/experiments/1/runs/<run id>`: the run's page in the UI."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
