"""Deploy: how `enn deploy` serves the flows (schedules) and `enn ui` shows MLflow."""

from __future__ import annotations

from enn_core.config.fields import frozen
from enn_core.errors import ConfigError


@frozen
class DeployConfig:
    cron: str = "0 3 * * *"
    """Cron schedule of the training deployment (server time zone)."""

    timezone: str = "UTC"
    """Time zone of the cron schedule."""

    host: str = "127.0.0.1"
    """Address the local Prefect and MLflow servers bind to (loopback only by default)."""

    prefect_port: int = 0
    """Port of the local `prefect server start`; 0 = a free port."""

    mlflow_port: int = 5000
    """Port of `enn ui` (mlflow server)."""

    training_deployment: str = "scheduled"
    """Name of the training flow's deployment."""

    prediction_deployment: str = "on-demand"
    """Name of the prediction flow's deployment."""

    tuning_deployment: str = "on-demand"
    """Name of the tuning flow's deployment (`enn tune` as a deployment, run on demand)."""

    def __post_init__(self) -> None:
        if len(self.cron.split()) != 5:
            raise ConfigError(
                f"deploy.cron={self.cron!r} needs 5 fields (minute hour day month weekday), "
                "e.g. '0 3 * * *'"
            )
        for name in ("prefect_port", "mlflow_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"deploy.{name} must be a port number (0-65535)")
