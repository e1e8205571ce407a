"""prepare-checkpoint: the initial checkpoint, seeded fresh or warm-started
(enn_core/init_checkpoint.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from enn_core.stages.spec import StageSpec
from enn_core.stages.stage_data import STAGE_DATA

if TYPE_CHECKING:
    from enn_core.config import RunConfig
    from enn_core.stage import StageContext
    from enn_core.summaries import InitSummary


def prepare_checkpoint(cfg: RunConfig, ctx: StageContext) -> InitSummary:
    from enn_core.init_checkpoint import run

    return run(cfg, ctx, staged=ctx.input(STAGE_DATA))


PREPARE_CHECKPOINT = StageSpec(
    key="prepare-checkpoint",
    name="prepare-checkpoint",
    flow="training",
    docs="docs/checkpoints.md",
    help="Write the initial checkpoint: a seeded fresh start or a warm start.",
    work=prepare_checkpoint,
    sections=("model", "checkpoint"),
    inputs=(STAGE_DATA,),
    code=("enn_core/model", "enn_core/init_checkpoint.py", "enn_core/checkpoint.py"),
    outputs=("init.pt", "init.json"),
    artifacts=("init.json",),
    model_refs=("checkpoint.init_from",),
    memory=("model.d_model", "model.layers"),
)
