"""Deploy: how `enn deploy` serves the flows (schedules) and `enn ui` shows MLflow."""

from __future__ import annotations

from enn_core.config.fields import frozen, opt
from enn_core.errors import ConfigError


@frozen
class DeployConfig:
    cron: str = opt("0 3 * * *", "Cron schedule of the training deployment (server time zone).")
    timezone: str = opt("UTC", "Time zone of the cron schedule.")
    host: str = opt(
        "127.0.0.1",
        "Address the local Prefect and MLflow servers bind to (loopback only by default).",
    )
    prefect_port: int = opt(0, "Port of the local `prefect server start`; 0 = a free port.")
    mlflow_port: int = opt(5000, "Port of `enn ui` (mlflow server).")
    training_deployment: str = opt("scheduled", "Name of the training flow's deployment.")
    prediction_deployment: str = opt("on-demand", "Name of the prediction flow's deployment.")

    def __post_init__(self) -> None:
        if len(self.cron.split()) != 5:
            raise ConfigError(
                f"deploy.cron={self.cron!r} needs 5 fields (minute hour day month weekday), e.g. '0 3 * * *'"
            )
        for name in ("prefect_port", "mlflow_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"deploy.{name} must be a port number (0-65535)")
