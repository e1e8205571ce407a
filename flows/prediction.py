"""The prediction flow: new data in, checked predictions in real units out.

    stage-data (features-only, against the training manifest) -> predict -> collapse-check

The same stage names as the training flow (one name everywhere), running the prediction
pipeline's stage specs (enn_core/stages/prediction.py) over `prediction/params.yaml`,
whose outputs live in `prediction/outputs/<stage>/` and whose DVC pipeline is
`prediction/dvc.yaml`. The model: `--model` (a checkpoint path, `models:/<name>@<alias>`, or
`champion`: this task's champion, `models:/enn-<training data>@champion`), else this task's
champion, downloaded to `prediction/model/` (predict.model's default, which DVC hashes) on
every run when tracking is on; a registered model is always predicted from that local copy.
Collapsed predictions are held back with the report and the flow fails.

Run: `enn run --flow prediction [--model champion | models:/NAME@ALIAS | PATH]`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import flow
from prefect.states import State

from enn_core.paths import project_root
from enn_core.stages import up_to
from flows.training import flow_console, load_once, run_name, run_stages
from tasks.runner import StageResult

DEFAULT_CONFIG = "prediction/params.yaml"


@flow(name="prediction", flow_run_name=run_name, persist_result=False, log_prints=True)
def prediction(
    config: str = DEFAULT_CONFIG,
    overrides: list[str] | None = None,
    model: str | None = None,
    until: str | None = None,
) -> dict[str, StageResult] | State:
    """Stage new data, predict with `model` (default: predict.model of the config), check collapse
    (a Cancelled state when the flow run is cancelled: flows.training.run_stages)."""
    with flow_console(config, overrides, "prediction"):
        return _prediction(config, list(overrides or []), model, until)


def _prediction(
    config: str, overrides: list[str], model: str | None, until: str | None
) -> dict[str, StageResult] | State:
    path = Path(config).resolve()
    cfg = load_once(path, overrides)
    root = project_root(path)
    from tasks.tracking.models import LOCAL_COPY, expand, materialize

    ref = expand(model or "", cfg, root)
    if not model and cfg.predict.model == LOCAL_COPY and cfg.tracking.enabled:
        ref = expand("champion", cfg, root)  # the default: refresh the local copy
    if ref.startswith(("models:/", "runs:/")):
        # A registry reference cannot be hashed by DVC: download that version next to the
        # pipeline (prediction/model/) and predict from the local copy, which DVC tracks.
        local = materialize(ref, root / Path(LOCAL_COPY).parent, cfg.tracking.uri or None)
        logging.getLogger("enn.flow").info("model %s -> %s", ref, local)
        if cfg.predict.model != LOCAL_COPY:
            overrides.append(f"predict.model={LOCAL_COPY}")
    elif model:
        overrides.append(f"predict.model={model}")
    return run_stages("prediction", config, overrides, up_to("prediction", until))


if __name__ == "__main__":
    prediction()
