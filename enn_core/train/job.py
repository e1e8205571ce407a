"""The worker job: what the distributed-train stage hands each of its worker processes.

    job = WorkerJob(config=cfg, staged=..., init=..., run_dir=..., result_dir=..., threads=2,
                    marker_dir=..., checkpoint=CheckpointPlan(dir=..., digest=...))
    path = job.write(run_dir / JOB_FILE)          # the stage (enn_core.train.stage)
    job = WorkerJob.read(path)                    # each worker (enn_core.train.worker)

A frozen record; JSON only at the file boundary, with a `format_version` that `read` checks:
a job file of another version (written by another version of this code, e.g. a worker of an
older install) is refused in one line instead of being half understood.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from enn_core.atomic import write_json
from enn_core.config import RunConfig, to_plain
from enn_core.config.loader import build
from enn_core.errors import StaleOutputError

FORMAT_VERSION = 1
JOB_FILE = "job.json"
SHARED_OUTPUTS = "published"  # under the job's checkpoint folder, which every node shares


@dataclass(frozen=True)
class CheckpointPlan:
    """The job's DCP checkpoint directory (keyed by its fingerprint) and what to start from."""

    dir: Path
    digest: str
    resume_from: Path | None = None  # an explicit checkpoint.resume_from (a committed step-*)
    weights_only: bool = False  # resume_from is another run's: take its weights only

    @property
    def resume_path(self) -> Path | None:
        """The checkpoint to continue exactly (same fingerprint), if one was named."""
        return None if self.weights_only else self.resume_from

    @property
    def weights_path(self) -> Path | None:
        """The checkpoint whose weights start the run (a warm start), if one was named."""
        return self.resume_from if self.weights_only else None

    def as_record(self) -> dict[str, Any]:
        return {
            "dir": str(self.dir),
            "digest": self.digest,
            "resume_from": str(self.resume_from) if self.resume_from else None,
            "weights_only": self.weights_only,
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> CheckpointPlan:
        source = rec.get("resume_from")
        return cls(
            dir=Path(rec["dir"]),
            digest=str(rec["digest"]),
            resume_from=Path(source) if source else None,
            weights_only=bool(rec.get("weights_only", False)),
        )


@dataclass(frozen=True)
class WorkerJob:
    """Everything a worker needs: the resolved config and the paths it reads and writes."""

    config: RunConfig
    staged: Path  # outputs/stage-data
    init: Path  # outputs/prepare-checkpoint/init.pt
    run_dir: Path  # logs, heartbeats, events (rank 0), error records
    result_dir: Path  # rank 0 writes model.pt, record.json, history.json here
    threads: int  # torch threads per worker
    marker_dir: Path  # where fired faults are counted across restarts
    stage: str = ""  # the stage's name, recorded in the consolidated checkpoint's meta
    checkpoint: CheckpointPlan | None = None  # None: no DCP checkpoints
    root: Path = Path(".")  # the project root: a custom model's factory is imported from it

    def as_record(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "config": to_plain(self.config),
            "staged": str(self.staged),
            "init": str(self.init),
            "run_dir": str(self.run_dir),
            "result_dir": str(self.result_dir),
            "threads": self.threads,
            "marker_dir": str(self.marker_dir),
            "stage": self.stage,
            "checkpoint": self.checkpoint.as_record() if self.checkpoint else None,
            "root": str(self.root),
        }

    def write(self, path: Path) -> Path:
        """Write the job file atomically; returns `path`."""
        write_json(path, self.as_record())
        return path

    @classmethod
    def read(cls, path: str | Path) -> WorkerJob:
        """The job of `path`; StaleOutputError for a file of another format version."""
        path = Path(path)
        rec = json.loads(path.read_text())
        version = rec.get("format_version") if isinstance(rec, dict) else None
        if version != FORMAT_VERSION:
            raise StaleOutputError(
                f"{path}: worker job format_version {version!r}, this worker reads "
                f"{FORMAT_VERSION}; re-run distributed-train with one install of the project"
            )
        ckpt = rec.get("checkpoint")
        return cls(
            config=build(RunConfig, rec["config"], root=RunConfig, where=str(path)),
            staged=Path(rec["staged"]),
            init=Path(rec["init"]),
            run_dir=Path(rec["run_dir"]),
            result_dir=Path(rec["result_dir"]),
            threads=int(rec["threads"]),
            marker_dir=Path(rec["marker_dir"]),
            stage=str(rec.get("stage") or ""),
            checkpoint=CheckpointPlan.from_record(ckpt) if ckpt else None,
            root=Path(rec.get("root") or "."),
        )
