"""What each stage's work returns: a small frozen record of paths, hashes and headline numbers.

Tasks hand these records to each other (pass paths, not payloads); JSON only at the file
boundary: the runner writes `as_dict()` to the run directory's `result.json`, Prefect shows
`headline()` as the stage's table, and `lineage()` tags the stage's MLflow run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

Scalar = str | int | float | bool | None


@dataclass(frozen=True, kw_only=True)
class StageSummary:
    """The base every stage summary extends: the stage's output folder, and, for a stage that
    ran as one node of a multi-node job (distributed-train, predict), how it ended there."""

    output: str = ""
    nodes: int = 1
    """Nodes of the job this stage ran in (more than 1: a multi-node job)."""

    node_only: bool = False
    """True on a node of a multi-node job that did not get global rank 0: it published nothing
    (`output` is empty); the node of global rank 0 publishes and runs the later stages."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def headline(self) -> dict[str, Scalar]:
        """Its scalar fields (the Prefect table, the CLI's closing line)."""
        return {k: v for k, v in self.as_dict().items() if isinstance(v, Scalar)}

    def lineage(self) -> dict[str, str]:
        """MLflow tags: what produced the model (world size, checkpoint step), when known."""
        return {}


@dataclass(frozen=True, kw_only=True)
class StagedSummary(StageSummary):
    """stage-data: the staged dataset's headline (its manifest holds the rest)."""

    n_rows: int
    splits: Mapping[str, int]
    content_hash: str
    mode: str
    seconds: float


@dataclass(frozen=True, kw_only=True)
class InitSummary(StageSummary):
    """prepare-checkpoint: the initial checkpoint and where its weights came from."""

    path: str
    sha256: str
    init_seed: int
    init_from: str
    warm_start: Mapping[str, Any] | None
    data_fingerprint: str
    parameters: int


@dataclass(frozen=True, kw_only=True)
class ValidateSummary(StageSummary):
    """validate: the headline metrics in real units and the naive predictors not beaten."""

    metrics_file: str
    breakdown: str
    flags: tuple[str, ...]
    val_mae: float
    test_mae: float
    test_rmse: float
    test_r2: float


@dataclass(frozen=True, kw_only=True)
class PredictSummary(StageSummary):
    """predict: what was predicted, with which model and prediction path, and how fast."""

    n_rows: int
    shape: tuple[int, ...]
    files: Mapping[str, str]
    model: str
    model_sha256: str
    input: str
    selection: str
    calibration: Mapping[str, Any]
    device: str
    device_reason: str
    world_size: int
    n_parts: int
    computed_parts: tuple[int, ...]
    reused_parts: tuple[int, ...]
    rows_computed: int
    discarded_parts: str | None  # why earlier parts were discarded; None when none were
    rows_per_second: float | None
    seconds: float


@dataclass(frozen=True, kw_only=True)
class CollapseSummary(StageSummary):
    """collapse-check: the chosen candidate and why."""

    chosen: str
    report: str
    calibration: str
    why: str


@dataclass(frozen=True, kw_only=True)
class ExportSummary(StageSummary):
    """export: each format's status, the sidecar and each format's parity gap."""

    formats: Mapping[str, str]
    sidecar: str
    parity: Mapping[str, float | None]


@dataclass(frozen=True, kw_only=True)
class CheckSummary(StageSummary):
    """The prediction flow's collapse-check: released, with the report's measures."""

    released: bool
    report: str
    measures: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class TrainSummary(StageSummary):
    """distributed-train: the workers' record (rank 0's summary with the restarts and each
    rank's phase; `record.json`) and its metrics under docs/metrics.md's names. On a node that
    did not host rank 0 the record holds this node's ranks and no outputs are written."""

    record: Mapping[str, Any]
    metrics: Mapping[str, float] = field(default_factory=dict)
    outputs: tuple[str, ...] = ()
    wall_s: float = 0.0
    logs: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The record with the stage's own fields (result.json; the Prefect task's table)."""
        return {
            **self.record,
            "output": self.output,
            "outputs": list(self.outputs),
            "wall_s": self.wall_s,
            "logs": self.logs,
            "metrics": dict(self.metrics),
        }

    def lineage(self) -> dict[str, str]:
        out = {}
        if isinstance(self.record.get("world_size"), int):
            out["enn.world_size"] = str(self.record["world_size"])
        step = self.record.get("checkpoint_step", self.record.get("global_step"))
        if isinstance(step, int):
            out["enn.checkpoint_step"] = str(step)
        return out
