"""What a stage is: one `StageSpec` per stage, read by everything that runs or shows stages.

The CLI subcommands, the Prefect tasks, the config sections a stage reads (its MLflow params
and fingerprint), the MLflow artifacts, the model bundle, the plots, the `dvc.yaml`
consistency test and the docs all derive from these records; nothing else names a stage.

A spec holds its work function by reference. The work functions in `enn_core/stages/` import
their implementation (and so torch) when they run, not when the registry is imported: `enn
--help` and `dvc status` stay fast, and a stage run under `dvc repro` imports only its own
code. That lazy import is the one place the registry reaches into the implementations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from enn_core.config import RunConfig
    from enn_core.paths import Layout
    from enn_core.stage import StageContext
    from enn_core.summaries import StageSummary

Flow = Literal["training", "prediction"]
# What a work function returns: its summary record (enn_core/summaries.py).
Work = Callable[["RunConfig", "StageContext"], "StageSummary"]


@dataclass(frozen=True, kw_only=True, eq=False)
class StageSpec:
    """One stage: its names, its work, what it reads and writes, and what the tracker logs."""

    key: str
    """Internal name, unique across flows. A training stage's key is its public name; the
    prediction flow's variants have their own (their public names repeat the training ones)."""

    name: str
    """Public name: the CLI subcommand, the DVC stage (`dvc_name`), the Prefect task, the MLflow
    run, the output folder `outputs/<name>/` of its pipeline."""

    flow: Flow
    """The flow (and `dvc.yaml`) it belongs to: `training` (the repository root) or
    `prediction` (`prediction/`)."""

    help: str
    """One line for `enn --help`."""

    work: Work
    """`work(cfg, ctx) -> summary`: the stage's work, in enn_core."""

    sections: tuple[str, ...] = ()
    """Config sections it reads: its MLflow params and `dvc.yaml` `params:`."""

    inputs: tuple[StageSpec, ...] = ()
    """Stages of its flow whose outputs it reads (`dvc.yaml` deps)."""

    optional_inputs: tuple[StageSpec, ...] = ()
    """Stages whose outputs it reads when they exist (not DVC dependencies)."""

    code: tuple[str, ...] = ()
    """enn_core paths of the code it runs, relative to the repository (`dvc.yaml` deps)."""

    outputs: tuple[str, ...] = ()
    """Files it writes into its output folder."""

    artifacts: tuple[str, ...] = ()
    """Output files logged to its MLflow run."""

    metrics: tuple[str, ...] = ()
    """The headline names of its `metrics.json` that dvc.yaml declares as metrics
    (`outputs/metrics/<name>.json`, what `dvc metrics show` and `dvc exp show` print: a few, so
    the tables fit a terminal); the rest stays in `outputs/<name>/metrics.json`."""

    plots: tuple[str, ...] = ()
    """PNG plots the tracker draws after it runs (names of `tasks.tracking.plots.PLOTS`)."""

    model_refs: tuple[str, ...] = ()
    """Config keys that may name a registered model (`models:/name@alias`, `runs:/...`); the
    task layer downloads it and passes a local path before the work runs."""

    bundle: tuple[str, ...] = ()
    """Output files that travel inside the registered model (its `enn/` folder)."""

    registers_model: bool = False
    """After it runs, the tracker logs and registers the exported model."""

    every_rank: bool = False
    """Its work runs on every rank of a launched job (torchrun, several nodes): a process other
    than global rank 0 may run it (its share of the work, nothing published); any other stage
    runs on global rank 0 alone."""

    memory: tuple[str, ...] = ()
    """The settings that lower what it holds in memory, named by its out-of-memory line
    (`enn_core.errors.out_of_memory`), e.g. `predict.batch_size`."""

    docs: str = "docs/getting-started.md"
    """The page of docs/ that covers it: `enn <name> --help` ends with it (a test checks the
    file exists)."""

    @property
    def dvc_name(self) -> str:
        """The stage's key in `dvc.yaml` (YAML keys take `_` where the name has `-`)."""
        return self.name.replace("-", "_")

    def output_dir(self, layout: Layout) -> Path:
        """Its output folder in the pipeline of `layout`."""
        return layout.outputs / self.name

    def __repr__(self) -> str:
        return f"StageSpec({self.key!r})"
