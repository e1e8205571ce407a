"""One "node" of a multi-node job, as a separate OS process: an elastic agent joining the
others at a c10d rendezvous on loopback. Two modes:

    python multinode_agent.py job JOB RUN_DIR ENDPOINT RDZV_ID MAX_RESTARTS
        enn_core.runtime.launch of the training worker on a job file, 1 worker, 2 nodes;
        writes <RUN_DIR>/agent.json: {"ranks": {global rank: summary}} or {"error": ...}
    python multinode_agent.py stage PROJECT ENDPOINT RDZV_ID OUT_JSON
        the distributed-train stage itself on PROJECT (a shared project: both nodes see the
        same data, checkpoints and outputs), configured as `enn distributed-train --set
        runtime.nnodes=2 --set runtime.rdzv_endpoint=... --set runtime.rdzv_id=...` would;
        writes OUT_JSON: {"summary": ..., "run_dir": ...} or {"error": ...}

Exit code 1 on a domain error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dist_fixtures import cfg_of, run_train

from enn_core.errors import EnnError
from enn_core.paths import Layout
from enn_core.runtime.launch import Rendezvous, launch
from enn_core.train import worker


def run_job(job: str, run_dir: str, endpoint: str, rdzv_id: str, max_restarts: str) -> dict:
    rdzv = Rendezvous(
        nnodes=2, endpoint=endpoint, run_id=rdzv_id, local_addr="127.0.0.1", timeout_s=120
    )
    results = launch(
        worker.main,
        (job,),
        nprocs=1,
        run_dir=run_dir,
        hang_timeout_s=60,
        rdzv=rdzv,
        timeout_s=240,
        max_restarts=int(max_restarts),
    )
    return {"ranks": {str(r): v for r, v in results.items()}}


def run_stage(project: str, endpoint: str, rdzv_id: str) -> dict:
    cfg = cfg_of(
        "runtime.world_size=1",
        "runtime.nnodes=2",
        f"runtime.rdzv_endpoint={endpoint}",
        f"runtime.rdzv_id={rdzv_id}",
        "runtime.local_addr=127.0.0.1",
    )
    summary, run_dir = run_train(Layout.for_root(project), cfg)
    return {"summary": summary, "run_dir": str(run_dir)}


def main(argv: list[str]) -> int:
    mode, *args = argv
    if mode == "job":
        out, work = Path(args[1]) / "agent.json", (lambda: run_job(*args))
    else:
        out, work = Path(args[3]), (lambda: run_stage(*args[:3]))
    try:
        rec = work()
    except EnnError as e:
        out.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 1
    out.write_text(json.dumps(rec, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
