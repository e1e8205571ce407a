"""Tracking: MLflow experiment and registry names (the task layer uses them; enn_core only
writes events files)."""

from __future__ import annotations

import re
from pathlib import Path

from enn_core.config.fields import frozen
from enn_core.config.urls import TRACKING_FIX, check_no_credentials
from enn_core.errors import ConfigError

_NAME = re.compile(r"[^A-Za-z0-9_.-]+")


@frozen
class TrackingConfig:
    enabled: bool = True
    """Record runs in MLflow (parent run per pipeline run, child run per stage)."""

    uri: str = ""
    """MLflow tracking URI; empty means SQLite under the work directory (work/mlflow/mlflow.db)."""

    experiment: str = "enn"
    """MLflow experiment name."""

    registered_model: str = ""
    """Registered model that exports become versions of: one per task (one schema: features,
    labels). Empty = `enn-<data>`, from the training data (`enn-synthetic` for the demo,
    `enn-speeds` for data.path speeds.csv); set it to keep one name across renamed files."""

    log_system_metrics: bool = False
    """MLflow system metrics (CPU, memory) during training: sampled every 10 s onto the
    pipeline's parent run (`system/...`) while the flow runs."""

    def __post_init__(self) -> None:
        if not self.experiment.strip():
            raise ConfigError("tracking.experiment is empty; give the MLflow experiment a name")
        check_no_credentials(self.uri, "tracking.uri", TRACKING_FIX)

    def model_name(self, source: str, path: str | None) -> str:
        """The registered model's name: `registered_model`, or `enn-<data>` derived from the
        training data (`source` = data.source, `path` = data.path)."""
        if self.registered_model.strip():
            return self.registered_model.strip()
        stem = "synthetic" if source == "synthetic" or not path else Path(path).stem
        return "enn-" + (_NAME.sub("-", stem).strip("-.") or "data")
