"""The prediction flow's stages: new data in, checked predictions out.

    stage-data (features only) -> predict -> collapse-check (targets-free)

Their public names are the training stages' (the CLI form `enn <stage> --pipeline prediction`,
`prediction/dvc.yaml`, the MLflow run names, `prediction/outputs/<stage>/`); their keys are
their own, since they run other work over the prediction pipeline's `prediction/params.yaml`
(enn_core/predict/flow_steps.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from enn_core.errors import ConfigError
from enn_core.stages.collapse_check import COLLAPSE_CHECK
from enn_core.stages.predict import PREDICT
from enn_core.stages.spec import StageSpec
from enn_core.stages.stage_data import STAGE_DATA, stage_data

if TYPE_CHECKING:
    from enn_core.config import RunConfig
    from enn_core.stage import StageContext
    from enn_core.summaries import CheckSummary, PredictSummary


def predict_new_data(cfg: RunConfig, ctx: StageContext) -> PredictSummary:
    from enn_core.predict.flow_steps import predict_new

    return predict_new(
        cfg, ctx, staged=ctx.input(STAGE_NEW_DATA), calibration_name=COLLAPSE_CHECK.name
    )


def check_new_predictions(cfg: RunConfig, ctx: StageContext) -> CheckSummary:
    from enn_core.predict.flow_steps import check_new

    if not cfg.data.training_manifest:
        raise ConfigError(
            "data.training_manifest is empty; point it at the training pipeline's "
            f"outputs/{STAGE_DATA.name}/manifest.json"
        )
    return check_new(
        cfg,
        ctx,
        staged=ctx.input(STAGE_NEW_DATA),
        predictions=ctx.input(PREDICT_NEW_DATA),
        training=ctx.layout.resolve(cfg.data.training_manifest).parent,
    )


STAGE_NEW_DATA = StageSpec(
    key="stage-new-data",
    name=STAGE_DATA.name,
    flow="prediction",
    help="Stage new inputs (features only) against the training manifest: its vocabularies, "
    "encodings and scaler.",
    work=stage_data,  # stage-data's own work; prediction/params.yaml sets data.features_only
    sections=("data",),
    code=("enn_core/data",),
    outputs=("manifest.json", "features.npy"),
    artifacts=STAGE_DATA.artifacts,
    memory=STAGE_DATA.memory,
)

PREDICT_NEW_DATA = StageSpec(
    key="predict-new-data",
    name=PREDICT.name,
    flow="prediction",
    help="Predict the new inputs with predict.model (a checkpoint or models:/NAME@ALIAS).",
    work=predict_new_data,
    sections=("data", "predict"),
    inputs=(STAGE_NEW_DATA,),
    code=("enn_core/predict", "enn_core/inference.py"),
    outputs=PREDICT.outputs,
    artifacts=PREDICT.artifacts,
    model_refs=("predict.model",),
    every_rank=True,
    memory=PREDICT.memory,
)

CHECK_NEW_PREDICTIONS = StageSpec(
    key="check-new-predictions",
    name=COLLAPSE_CHECK.name,
    flow="prediction",
    help="Check the new predictions against the training targets' spread; hold back "
    "collapsed ones.",
    work=check_new_predictions,
    sections=("collapse",),
    inputs=(STAGE_NEW_DATA, PREDICT_NEW_DATA),
    code=("enn_core/collapse", "enn_core/predict"),
    outputs=("report.json",),
    artifacts=("report.json",),
)
