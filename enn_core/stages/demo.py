"""Small staged datasets for tests and demos of the later stages.

    from enn_core.stages.demo import stage_synthetic
    path = stage_synthetic(tmp_path)                  # tmp_path/outputs/stage-data
    ds = StagedDataset(path)                          # 144 rows, labels [6, 8]

Keyword arguments override SyntheticConfig fields (n_months, n_sections, noise, ...);
`data=` passes a whole DataConfig (e.g. with folds); `**data_fields` via `data_overrides=`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from enn_core.config import DataConfig, RunConfig, SyntheticConfig
from enn_core.paths import Layout
from enn_core.stage import make_context
from enn_core.stages.stage_data import STAGE_DATA

SMALL = {
    "n_months": 12,
    "n_daytypes": 3,
    "n_directions": 2,
    "n_sections": 6,
    "n_hours": 8,
    "n_replicates": 2,
}


def small_config(data_overrides: dict[str, Any] | None = None, **synthetic: Any) -> DataConfig:
    """A DataConfig for a small synthetic set: SMALL sizes, overridden by `synthetic`."""
    syn = SyntheticConfig(**{**SMALL, **synthetic})
    return DataConfig(synthetic=syn, **(data_overrides or {}))


def stage_synthetic(
    root: str | Path,
    *,
    data: DataConfig | None = None,
    data_overrides: dict[str, Any] | None = None,
    run_id: str = "test",
    **synthetic: Any,
) -> Path:
    """Stage a small synthetic dataset under `root`; returns `root/outputs/stage-data`."""
    data = data or small_config(data_overrides, **synthetic)
    cfg = dataclasses.replace(RunConfig(), data=data)
    ctx = make_context(cfg, Layout.for_root(root), STAGE_DATA, run_id)
    STAGE_DATA.work(cfg, ctx)
    return ctx.output()
