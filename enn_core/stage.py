"""The contract between a stage's work (here, in enn_core) and whoever runs it (the Prefect
task, `enn <stage>` under `dvc repro`, or a test).

Every stage is one function `run(cfg: RunConfig, ctx: StageContext) -> dict`. It reads its
inputs from `ctx.output(<upstream stage>)`, writes its own outputs atomically into
`ctx.output()` (enn_core.atomic.atomic_dir), writes metrics and events through `ctx.events`,
and returns a small JSON-able summary (paths, hashes, headline metrics). It never imports
prefect, mlflow or dvc.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from enn_core.events import EventLog
from enn_core.fault import FaultInjector
from enn_core.paths import Layout


@dataclass(frozen=True)
class StageContext:
    stage: str
    layout: Layout
    run_dir: Path
    events: EventLog
    faults: FaultInjector
    progress: bool = True
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("enn"))

    def output(self, stage: str | None = None) -> Path:
        """The output directory of `stage` (default: this stage)."""
        return self.layout.output(stage or self.stage)


def make_context(cfg, layout: Layout, stage: str, run_id: str) -> StageContext:
    """A context for running a stage directly (tests, benchmarks)."""
    run_dir = layout.run_dir(run_id, stage)
    run_dir.mkdir(parents=True, exist_ok=True)
    return StageContext(
        stage=stage,
        layout=layout,
        run_dir=run_dir,
        events=EventLog(run_dir),
        faults=FaultInjector(cfg.fault, marker_dir=run_dir.parent),
        progress=cfg.runtime.progress,
        logger=logging.getLogger(f"enn.{stage}"),
    )
