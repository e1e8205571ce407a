"""Deployments: the training flow on a cron schedule, the prediction and tuning flows on demand,
served by this process against a Prefect server.

    enn deploy            # starts `prefect server start` on 127.0.0.1 (a free port) and serves
    PREFECT_API_URL=http://host:4200/api enn deploy   # serve against an existing server

Schedules need a real server (the temporary local API cannot schedule). The server runs in
its own process group and is stopped with it when this command ends (Ctrl-C).
Trigger the prediction flow: `prefect deployment run prediction/on-demand` (with
PREFECT_API_URL set to the printed URL).
"""

from __future__ import annotations

import os
from pathlib import Path

from enn_core.config import RunConfig
from enn_core.paths import Layout, project_root
from flows.servers import prefect_server


def build_deployments(cfg: RunConfig, config: Path, prediction_config: Path) -> list:
    from prefect.schedules import Cron

    from flows.prediction import prediction
    from flows.training import training
    from flows.tuning import tuning

    train = training.to_deployment(
        name=cfg.deploy.training_deployment,
        schedules=[Cron(cfg.deploy.cron, timezone=cfg.deploy.timezone)],
        parameters={"config": str(config)},
        description="The seven training stages on a schedule (DVC skips what is up to date).",
    )
    predict = prediction.to_deployment(
        name=cfg.deploy.prediction_deployment,
        parameters={"config": str(prediction_config)},
        description="Stage new data, predict, check collapse; on demand.",
    )
    tune = tuning.to_deployment(
        name=cfg.deploy.tuning_deployment,
        parameters={"config": str(config)},
        description="Run or resume the study the config's tune: section declares; on demand.",
    )
    return [train, predict, tune]


def serve_all(cfg: RunConfig, config: Path, prediction_config: Path, api_url: str) -> None:
    from prefect import serve
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}):
        print(f"serving deployments against {api_url} (Ctrl-C stops)", flush=True)
        serve(*build_deployments(cfg, config, prediction_config))


def deploy(cfg: RunConfig, config: Path, prediction_config: Path) -> int:
    layout = Layout.for_root(project_root(config), cfg.runtime.work_dir)
    api = os.environ.get("PREFECT_API_URL")
    if api:
        serve_all(cfg, config, prediction_config, api)
        return 0
    with prefect_server(
        cfg.deploy.host, cfg.deploy.prefect_port, layout.work / "logs" / "prefect-server.log"
    ) as api:
        print(f"Prefect server: {api}", flush=True)
        serve_all(cfg, config, prediction_config, api)
    return 0
