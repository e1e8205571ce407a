"""stage-data: the declared input to versioned memmaps with a manifest (enn_core/data/)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from enn_core.stages.spec import StageSpec

if TYPE_CHECKING:
    from enn_core.config import RunConfig
    from enn_core.stage import StageContext
    from enn_core.summaries import StagedSummary


def stage_data(cfg: RunConfig, ctx: StageContext) -> StagedSummary:
    from enn_core.data.staging import run  # torch-free registry: the work imports its code

    return run(cfg, ctx)


STAGE_DATA = StageSpec(
    key="stage-data",
    name="stage-data",
    flow="training",
    docs="docs/your-data.md",
    help="Stage the input (npy/npz, CSV, Parquet, workbook or synthetic) to versioned memmaps "
    "with a manifest.",
    work=stage_data,
    sections=("data",),
    code=("enn_core/data", "enn_core/atomic.py"),
    outputs=("manifest.json", "features.npy"),
    artifacts=("manifest.json",),
    memory=("data.chunk_rows",),
)
