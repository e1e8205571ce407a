"""Scale-out test helpers: a job file for the real training worker, and a worker entry that
passes train.hsdp_replicas to bootstrap.

`main(job_path)` is `enn_core.train.worker.main` with `bootstrap` given the config's
`hsdp_replicas`, so the HSDP test runs the real worker, loop and step on a 2-D mesh until
the worker passes the keyword itself (then the wrapper changes nothing: the worker's own
keyword wins). `main_each` trains several jobs one after the other in the same workers
(one spawn for an A/B pair: spawning is most of a tiny run's time on two cores). It lives in
a module of its own so spawned workers can import it.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from enn_core.config import RunConfig, to_plain
from enn_core.config.loader import build
from enn_core.paths import Layout
from enn_core.runtime import dist
from enn_core.train import worker


def write_job(
    layout: Layout, cfg: RunConfig, run_dir: Path, result_dir: Path, name: str = "job"
) -> Path:
    """The job file enn_core.train.stage.run writes, for a run dir of our choosing (the
    launcher's: the watchdog reads the heartbeats the workers write there)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    job = {
        "config": to_plain(cfg), "staged": str(layout.output("stage-data")),
        "init": str(layout.output("prepare-checkpoint") / "init.pt"), "run_dir": str(run_dir),
        "result_dir": str(result_dir), "threads": cfg.runtime.threads_per_worker or 1,
        "marker_dir": str(run_dir),
    }  # fmt: skip
    path = run_dir / f"{name}.json"
    path.write_text(json.dumps(job, indent=2, default=str))
    return path


def main(job_path: str) -> dict[str, Any]:
    """The training worker with the mesh the config asks for."""
    job = json.loads(Path(job_path).read_text())
    cfg: RunConfig = build(RunConfig, job["config"], root=RunConfig, where=job_path)
    replicas = cfg.train.hsdp_replicas
    worker.bootstrap = functools.partial(_bootstrap, replicas)
    return worker.main(job_path)


def _bootstrap(replicas: int, **kwargs: Any) -> dist.DistEnv:
    kwargs.setdefault("hsdp_replicas", replicas)
    return dist.bootstrap(**kwargs)


def main_each(*job_paths: str) -> list[dict[str, Any]]:
    """`main` on each job in turn; each gets a process group on a store prefix of its own."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    out = []
    for i, job_path in enumerate(job_paths):
        os.environ["TORCHELASTIC_RUN_ID"] = f"{run_id}-job{i}"
        out.append(main(job_path))
    return out
