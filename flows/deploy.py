"""Deployments: the training flow on a cron schedule, the prediction and tuning flows on demand,
served by this process against a Prefect server.

    enn deploy            # starts `prefect server start` on 127.0.0.1 (a free port) and serves
    PREFECT_API_URL=http://host:4200/api enn deploy   # serve against an existing server

Schedules need a real server (the temporary local API cannot schedule). The server runs in
its own process group and is stopped with it when this command ends (Ctrl-C).
It prints each deployment with its schedule and a trigger command that works from any shell
(`PREFECT_API_URL=<its URL> .../prefect deployment run 'prediction/on-demand'`).

One flow run at a time (`serve(limit=1)`): every flow takes the work directory's pipeline lock
(tasks/lock.py), so a second run started beside the first (the cron firing during a triggered
run, two triggers) would fail at once on the lock. Prefect's runner leaves it scheduled instead
and starts it when the first ends; the UI shows it as late meanwhile.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from enn_core.config import RunConfig, redact_url
from enn_core.paths import Layout, project_root
from flows.servers import prefect_server

RUNS_AT_ONCE = 1  # the flows share one work directory and its lock: the others wait their turn


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
        deployments = build_deployments(cfg, config, prediction_config)
        for line in banner(deployments, api_url):
            print(line, flush=True)
        # Prefect's own banner suggests `prefect deployment run ...`, which another shell runs
        # against its own temporary API ("Deployment not found"): ours names PREFECT_API_URL
        serve(*deployments, print_starting_message=False, limit=RUNS_AT_ONCE)


def banner(deployments: list, api_url: str) -> list[str]:
    """What `enn deploy` serves, each deployment's schedule (its next runs) or "on demand",
    a trigger command that works as printed from any shell, and the UI's page."""
    exe = Path(sys.executable).parent / "prefect"
    api_url = redact_url(api_url)  # shown: a user or token in PREFECT_API_URL stays out
    lines = [
        f"serving {len(deployments)} deployments against {api_url}, one run at a time "
        "(Ctrl-C stops):"
    ]
    for d in deployments:
        name = f"{d.flow_name}/{d.name}"
        lines.append(f"  {name:24s} {schedule_text(d)}")
    on_demand = next((d for d in deployments if d.flow_name == "prediction"), deployments[0])
    lines.append(
        f"trigger a run: PREFECT_API_URL={api_url} {exe} deployment run "
        f"'{on_demand.flow_name}/{on_demand.name}'"
    )
    lines.append(f"Prefect UI: {api_url.removesuffix('/api')}/deployments")
    return lines


def schedule_text(deployment: object) -> str:
    """`cron '0 3 * * *' (UTC): next 2026-11-26 03:00, 2026-11-27 03:00`, or `on demand`."""
    import asyncio

    from prefect.server.schemas.schedules import CronSchedule

    schedules = getattr(deployment, "schedules", None) or []
    texts = []
    for s in schedules:
        cron = getattr(s.schedule, "cron", None)
        if cron is None:
            texts.append(str(s.schedule))
            continue
        tz = getattr(s.schedule, "timezone", None) or "UTC"
        dates = asyncio.run(CronSchedule(cron=cron, timezone=tz).get_dates(n=2))
        nxt = ", ".join(f"{d:%Y-%m-%d %H:%M}" for d in dates)
        texts.append(f"cron '{cron}' ({tz}): next {nxt}")
    return "; ".join(texts) or "on demand"


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
