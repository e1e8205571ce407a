"""distributed-train: elastic workers (FSDP2 when world size > 1), DCP checkpoints, the
consolidated model (enn_core/train/)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from enn_core.metric_names import DVC_TRAIN
from enn_core.stages.prepare_checkpoint import PREPARE_CHECKPOINT
from enn_core.stages.spec import StageSpec
from enn_core.stages.stage_data import STAGE_DATA

if TYPE_CHECKING:
    from enn_core.config import RunConfig
    from enn_core.stage import StageContext
    from enn_core.summaries import TrainSummary


def distributed_train(cfg: RunConfig, ctx: StageContext) -> TrainSummary:
    from enn_core.train.stage import run

    return run(cfg, ctx, staged=ctx.input(STAGE_DATA), init=ctx.input(PREPARE_CHECKPOINT))


DISTRIBUTED_TRAIN = StageSpec(
    key="distributed-train",
    name="distributed-train",
    flow="training",
    docs="docs/checkpoints.md",
    help="Train in elastic worker processes (FSDP2 when world size > 1); writes the "
    "consolidated checkpoint.",
    work=distributed_train,
    sections=("model", "train", "checkpoint"),
    inputs=(STAGE_DATA, PREPARE_CHECKPOINT),
    code=("enn_core/train", "enn_core/runtime", "enn_core/model", "enn_core/losses.py"),
    outputs=("model.pt", "record.json", "metrics.json", "history.json"),
    artifacts=("model.pt", "record.json", "metrics.json", "history.json"),
    metrics=DVC_TRAIN,
    plots=("loss_curves",),
    bundle=("model.pt",),
    every_rank=True,
    memory=("train.batch_size", "train.micro_batch", "train.eval_batch", "runtime.world_size"),
)
