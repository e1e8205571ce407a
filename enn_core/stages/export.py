"""export: the chosen prediction path to torch.export and ONNX, with parity checks and a
sidecar; the tracker registers it (enn_core/export.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from enn_core.stages.collapse_check import COLLAPSE_CHECK
from enn_core.stages.distributed_train import DISTRIBUTED_TRAIN
from enn_core.stages.spec import StageSpec
from enn_core.stages.stage_data import STAGE_DATA

if TYPE_CHECKING:
    from enn_core.config import RunConfig
    from enn_core.stage import StageContext
    from enn_core.summaries import ExportSummary


def export(cfg: RunConfig, ctx: StageContext) -> ExportSummary:
    from enn_core.export import run

    return run(
        cfg,
        ctx,
        staged=ctx.input(STAGE_DATA),
        trained=ctx.input(DISTRIBUTED_TRAIN),
        calibration=ctx.input(COLLAPSE_CHECK),
    )


EXPORT = StageSpec(
    key="export",
    name="export",
    flow="training",
    docs="docs/serving.md",
    help="Export the chosen prediction path to torch.export and ONNX, with parity checks and a "
    "sidecar.",
    work=export,
    sections=("export",),
    inputs=(STAGE_DATA, DISTRIBUTED_TRAIN, COLLAPSE_CHECK),
    code=(
        "enn_core/export.py",
        "enn_core/export_cache.py",
        "enn_core/onnx_program.py",
        "enn_core/inference.py",
        "enn_core/collapse",
    ),
    outputs=("sidecar.json", "parity.json", "metrics.json"),
    artifacts=("sidecar.json", "parity.json"),
    bundle=("sidecar.json", "parity.json", "model.pt2"),
    registers_model=True,
    memory=("export.example_batch", "export.parity_batch_sizes", "export.parity_rows"),
)
