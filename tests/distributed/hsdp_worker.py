"""Scale-out test helpers: a job file for the real training worker, and a worker entry that
trains several jobs one after the other in the same workers.

`main_each` gives two runs (FSDP on 4, HSDP 2 x 2) one spawn: spawning four workers is most of
a tiny run's time on two shared cores. `probe_shared` runs the shared-directory check. They
live in a module of their own so spawned workers can import them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from enn_core.config import RunConfig
from enn_core.paths import Layout
from enn_core.runtime import dist
from enn_core.stages import PREPARE_CHECKPOINT, STAGE_DATA
from enn_core.train import worker
from enn_core.train.job import CheckpointPlan, WorkerJob


def write_job(
    layout: Layout,
    cfg: RunConfig,
    run_dir: Path,
    result_dir: Path,
    name: str = "job",
    checkpoint: CheckpointPlan | None = None,
) -> Path:
    """The job file enn_core.train.stage.run writes, for a run dir of our choosing (the
    launcher's: the watchdog reads the heartbeats the workers write there); no DCP
    checkpoints unless `checkpoint` (enn_core.train.stage.checkpoint_spec) is given."""
    run_dir.mkdir(parents=True, exist_ok=True)
    job = WorkerJob(
        config=cfg,
        staged=STAGE_DATA.output_dir(layout),
        init=PREPARE_CHECKPOINT.output_dir(layout) / "init.pt",
        run_dir=run_dir,
        result_dir=result_dir,
        threads=cfg.runtime.threads_per_worker or 1,
        marker_dir=run_dir,
        checkpoint=checkpoint,
    )
    return job.write(run_dir / f"{name}.json")


def main_each(*job_paths: str) -> list[dict[str, Any]]:
    """The training worker on each job in turn; each gets a process group on a store prefix
    of its own (the prefix is keyed by the run id)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    out = []
    for i, job_path in enumerate(job_paths):
        os.environ["TORCHELASTIC_RUN_ID"] = f"{run_id}-job{i}"
        out.append(worker.main(job_path))
    return out


def probe_shared(dirs: list[str]) -> list[int]:
    """A worker: bootstrap, then ranks_not_sharing on this rank's entry of `dirs`."""
    rank = int(os.environ["RANK"])
    env = dist.bootstrap(device="cpu", threads=1, seed=0, deterministic=False, pg_timeout_s=60)
    try:
        return dist.ranks_not_sharing(dirs[rank], env)
    finally:
        dist.shutdown()
