"""The prediction pipeline's stage functions, in the `run(cfg, ctx)` shape every stage has.

Its stage-data is the training one in features-only mode (`data.features_only` and
`data.training_manifest` in prediction/params.yaml); these two read the pipeline's own
outputs (`ctx.output(...)` under prediction/outputs/) and the config's paths, which resolve
from the pipeline's folder.
"""

from __future__ import annotations

from pathlib import Path

from enn_core.errors import ConfigError
from enn_core.predict import flow_steps


def _training_data_dir(cfg, ctx) -> Path:
    if not cfg.data.training_manifest:
        raise ConfigError(
            "data.training_manifest is empty; point it at the training pipeline's outputs/stage-data/manifest.json"
        )
    return ctx.layout.resolve(cfg.data.training_manifest).parent


def run_predict(cfg, ctx) -> dict:
    """predict over the features-only data this pipeline staged, with `predict.model`."""
    if not cfg.predict.model:
        raise ConfigError(
            "predict.model is empty; give a consolidated checkpoint path or models:/NAME@ALIAS"
        )
    model = ctx.layout.resolve(cfg.predict.model)
    return flow_steps.predict(cfg, ctx, input_dir=ctx.output("stage-data"), model_path=model)


def run_check(cfg, ctx) -> dict:
    """collapse-check of the new predictions against the training targets' spread."""
    return flow_steps.check_predictions(
        cfg,
        ctx,
        predictions_dir=ctx.output("predict"),
        input_dir=ctx.output("stage-data"),
        training_data_dir=_training_data_dir(cfg, ctx),
    )
