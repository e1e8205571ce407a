"""collapse-check: the candidates side by side (raw, calibrated, fp32, per-sample), the
cause of a collapse, the chosen prediction path (enn_core/collapse.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from enn_core.stages.distributed_train import DISTRIBUTED_TRAIN
from enn_core.stages.spec import StageSpec
from enn_core.stages.stage_data import STAGE_DATA

if TYPE_CHECKING:
    from enn_core.config import RunConfig
    from enn_core.stage import StageContext
    from enn_core.summaries import CollapseSummary


def collapse_check(cfg: RunConfig, ctx: StageContext) -> CollapseSummary:
    from enn_core.collapse.stage import run

    return run(cfg, ctx, staged=ctx.input(STAGE_DATA), trained=ctx.input(DISTRIBUTED_TRAIN))


COLLAPSE_CHECK = StageSpec(
    key="collapse-check",
    name="collapse-check",
    flow="training",
    docs="docs/serving.md",
    help="Detect prediction collapse; compare raw, calibrated, fp32 and per-sample "
    "candidates; choose one.",
    work=collapse_check,
    sections=("collapse",),
    inputs=(STAGE_DATA, DISTRIBUTED_TRAIN),
    code=(
        "enn_core/collapse",
        "enn_core/inference.py",
        "enn_core/metrics.py",
        "enn_core/baselines.py",
    ),
    outputs=("report.json", "metrics.json", "reference.npy"),
    artifacts=("report.json", "calibration.json"),
    bundle=("calibration.json", "slope.npy", "intercept.npy", "report.json", "reference.npy"),
    memory=("collapse.max_rows", "collapse.batch_size"),
)
