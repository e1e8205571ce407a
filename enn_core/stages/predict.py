"""predict: chunked, resumable prediction in real units (enn_core/predict/)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from enn_core.stages.collapse_check import COLLAPSE_CHECK
from enn_core.stages.distributed_train import DISTRIBUTED_TRAIN
from enn_core.stages.spec import StageSpec
from enn_core.stages.stage_data import STAGE_DATA

if TYPE_CHECKING:
    from enn_core.config import RunConfig
    from enn_core.stage import StageContext
    from enn_core.summaries import PredictSummary


def predict(cfg: RunConfig, ctx: StageContext) -> PredictSummary:
    from enn_core.predict.stage import run

    return run(
        cfg,
        ctx,
        staged=ctx.input(STAGE_DATA),
        model=ctx.input(DISTRIBUTED_TRAIN) / "model.pt",
        calibration=ctx.input(COLLAPSE_CHECK),
        calibration_name=COLLAPSE_CHECK.name,
    )


PREDICT = StageSpec(
    key="predict",
    name="predict",
    flow="training",
    docs="docs/serving.md",
    help="Chunked, resumable prediction in real units (predictions.npy, Parquet, workbook).",
    work=predict,
    sections=("data", "predict"),
    inputs=(STAGE_DATA, DISTRIBUTED_TRAIN),
    optional_inputs=(COLLAPSE_CHECK,),
    code=("enn_core/predict", "enn_core/inference.py"),
    outputs=("predictions.npy", "predictions.parquet", "manifest.json"),
    artifacts=("manifest.json",),
    plots=("predictions",),
    model_refs=("predict.model",),
    every_rank=True,
    memory=("predict.batch_size", "predict.chunk_rows", "predict.world_size"),
)
