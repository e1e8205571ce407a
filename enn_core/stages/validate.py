"""validate: metrics in real units on the validation and test splits, against the naive
predictors and the fitted baselines (enn_core/validate.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from enn_core.metric_names import DVC_VALIDATE
from enn_core.stages.distributed_train import DISTRIBUTED_TRAIN
from enn_core.stages.spec import StageSpec
from enn_core.stages.stage_data import STAGE_DATA

if TYPE_CHECKING:
    from enn_core.config import RunConfig
    from enn_core.stage import StageContext
    from enn_core.summaries import ValidateSummary


def validate(cfg: RunConfig, ctx: StageContext) -> ValidateSummary:
    from enn_core.validate import run

    return run(cfg, ctx, staged=ctx.input(STAGE_DATA), trained=ctx.input(DISTRIBUTED_TRAIN))


VALIDATE = StageSpec(
    key="validate",
    name="validate",
    flow="training",
    docs="docs/quality.md",
    help="Metrics on the validation and test splits in real units, against the baselines.",
    work=validate,
    sections=("validate",),
    inputs=(STAGE_DATA, DISTRIBUTED_TRAIN),
    code=(
        "enn_core/validate.py",
        "enn_core/metrics.py",
        "enn_core/inference.py",
        "enn_core/baselines.py",
        "enn_core/fitted_baselines.py",
    ),
    outputs=("metrics.json", "breakdown.json"),
    artifacts=("metrics.json", "breakdown.json"),
    metrics=DVC_VALIDATE,
    memory=("validate.baseline_max_rows", "predict.batch_size", "data.chunk_rows"),
)
