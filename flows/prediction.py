"""The prediction flow: new data in, checked predictions in real units out.

    stage-data (features-only, against the training manifest) -> predict -> collapse-check

The same stage names as the training flow (one name everywhere), running the prediction
pipeline's stage specs (enn_core/stages/prediction.py) over `prediction/params.yaml`,
whose outputs live in `prediction/outputs/<stage>/` and whose DVC pipeline is
`prediction/dvc.yaml`. The model is a checkpoint path or a registered version
(`models:/enn-model@champion`), resolved to a local folder by the task layer.
Collapsed predictions are held back with the report and the flow fails.

Run: `enn run --flow prediction [--model models:/enn-model@champion]`.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.states import State

from enn_core.paths import project_root
from enn_core.stages import up_to
from flows.training import run_stages
from tasks.runner import StageResult

DEFAULT_CONFIG = "prediction/params.yaml"


@flow(name="prediction", persist_result=False, log_prints=True)
def prediction(
    config: str = DEFAULT_CONFIG,
    overrides: list[str] | None = None,
    model: str | None = None,
    until: str | None = None,
) -> dict[str, StageResult] | State:
    """Stage new data, predict with `model` (default: predict.model of the config), check collapse
    (a Cancelled state when the flow run is cancelled: flows.training.run_stages)."""
    overrides = list(overrides or [])
    if model and model.startswith(("models:/", "runs:/")):
        # A registry reference cannot be hashed by DVC: download that version next to the
        # pipeline (prediction/model/) and predict from the local copy, which DVC tracks.
        from flows.training import load_once
        from tasks.tracking.models import materialize

        root = project_root(config)
        uri = load_once(Path(config).resolve(), overrides).tracking.uri  # an MLflow server
        local = materialize(model, root / "model", uri or None)
        get_run_logger().info("model %s -> %s", model, local)
        overrides.append(f"predict.model={local.relative_to(root)}")
    elif model:
        overrides.append(f"predict.model={model}")
    return run_stages("prediction", config, overrides, up_to("prediction", until))


if __name__ == "__main__":
    prediction()
