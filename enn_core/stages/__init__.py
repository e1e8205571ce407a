"""The stage registry: every stage of both flows, in order. Importing it imports no torch.

    from enn_core.stages import TRAINING, PREDICTION, lookup
    for spec in TRAINING: spec.name, spec.sections, spec.work(cfg, ctx) ...

Adding a stage: its spec and work function (a module here named after it), its implementation
in enn_core, its entry in the flow's tuple below and in that flow's `dvc.yaml`
(docs/design.md, "Adding a stage"; tests/unit/stages/test_registry.py checks them).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from enn_core.errors import ConfigError
from enn_core.stage import make_context
from enn_core.stages.collapse_check import COLLAPSE_CHECK
from enn_core.stages.distributed_train import DISTRIBUTED_TRAIN
from enn_core.stages.export import EXPORT
from enn_core.stages.predict import PREDICT
from enn_core.stages.prediction import CHECK_NEW_PREDICTIONS, PREDICT_NEW_DATA, STAGE_NEW_DATA
from enn_core.stages.prepare_checkpoint import PREPARE_CHECKPOINT
from enn_core.stages.spec import Flow, StageSpec
from enn_core.stages.stage_data import STAGE_DATA
from enn_core.stages.validate import VALIDATE

if TYPE_CHECKING:
    from enn_core.config import RunConfig
    from enn_core.paths import Layout
    from enn_core.summaries import StageSummary

TRAINING: tuple[StageSpec, ...] = (
    STAGE_DATA,
    PREPARE_CHECKPOINT,
    DISTRIBUTED_TRAIN,
    VALIDATE,
    PREDICT,
    COLLAPSE_CHECK,
    EXPORT,
)
PREDICTION: tuple[StageSpec, ...] = (STAGE_NEW_DATA, PREDICT_NEW_DATA, CHECK_NEW_PREDICTIONS)
FLOWS: dict[Flow, tuple[StageSpec, ...]] = {"training": TRAINING, "prediction": PREDICTION}
ALL: tuple[StageSpec, ...] = TRAINING + PREDICTION


def lookup(name: str, flow: Flow = "training") -> StageSpec:
    """The spec of public name `name` in `flow`; a ConfigError naming the choices otherwise."""
    for spec in FLOWS[flow]:
        if spec.name == name:
            return spec
    names = [s.name for s in FLOWS[flow]]
    raise ConfigError(f"{name!r} is not a stage of the {flow} flow; pick one of {names}")


def up_to(flow: Flow, last: str | None) -> tuple[StageSpec, ...]:
    """The stages of `flow` up to and including the one named `last` (all when None)."""
    stages = FLOWS[flow]
    if last is None:
        return stages
    names = [s.name for s in stages]
    if last not in names:
        raise ConfigError(
            f"--until {last!r} is not a stage of the {flow} flow; pick one of {names}"
        )
    return stages[: names.index(last) + 1]


def run_direct(
    spec: StageSpec,
    cfg: RunConfig,
    layout: Layout,
    run_id: str = "direct",
    cancel: threading.Event | None = None,
) -> StageSummary:
    """One stage's work in this process, without Prefect, MLflow or DVC (tests, benchmarks,
    the doctor); the pipeline runs stages through tasks/runner.py."""
    return spec.work(cfg, make_context(cfg, layout, spec, run_id, cancel))


__all__ = [
    "ALL",
    "CHECK_NEW_PREDICTIONS",
    "COLLAPSE_CHECK",
    "DISTRIBUTED_TRAIN",
    "EXPORT",
    "FLOWS",
    "PREDICT",
    "PREDICTION",
    "PREDICT_NEW_DATA",
    "PREPARE_CHECKPOINT",
    "STAGE_DATA",
    "STAGE_NEW_DATA",
    "TRAINING",
    "VALIDATE",
    "Flow",
    "StageSpec",
    "lookup",
    "run_direct",
    "up_to",
]
