"""Tracking: MLflow experiment and registry names (the task layer uses them; enn_core only
writes events files)."""

from __future__ import annotations

from enn_core.config.fields import frozen
from enn_core.errors import ConfigError


@frozen
class TrackingConfig:
    enabled: bool = True
    """Record runs in MLflow (parent run per pipeline run, child run per stage)."""

    uri: str = ""
    """MLflow tracking URI; empty means SQLite under the work directory (work/mlflow/mlflow.db)."""

    experiment: str = "enn"
    """MLflow experiment name."""

    registered_model: str = "enn-model"
    """Registered model name for exported models."""

    log_system_metrics: bool = False
    """MLflow system metrics (CPU, memory) during training."""

    def __post_init__(self) -> None:
        if not self.experiment.strip():
            raise ConfigError("tracking.experiment is empty; give the MLflow experiment a name")
