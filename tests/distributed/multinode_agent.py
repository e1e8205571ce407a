"""One "node" of a multi-node job: an elastic agent (enn_core.runtime.launch) running the real
training worker on a job file, joining the others at a c10d rendezvous.

    python multinode_agent.py JOB RUN_DIR ENDPOINT RDZV_ID NNODES NPROCS MAX_RESTARTS

Writes `<RUN_DIR>/agent.json`: {"ranks": this node's global ranks and their summaries} or
{"error": "<class>: <message>"} (exit code 1). The multi-node test starts two of these as
separate OS processes on loopback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from enn_core.errors import EnnError
from enn_core.runtime.launch import Rendezvous, launch
from enn_core.train import worker


def main(argv: list[str]) -> int:
    job, run_dir, endpoint, rdzv_id, nnodes, nprocs, max_restarts = argv
    rdzv = Rendezvous(nnodes=int(nnodes), endpoint=endpoint, run_id=rdzv_id,
                      local_addr="127.0.0.1", timeout_s=120)  # fmt: skip
    out = Path(run_dir) / "agent.json"
    try:
        results = launch(worker.main, (job,), nprocs=int(nprocs), run_dir=run_dir,
                         hang_timeout_s=60, rdzv=rdzv, timeout_s=240,
                         max_restarts=int(max_restarts))  # fmt: skip
    except EnnError as e:
        out.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 1
    out.write_text(json.dumps({"ranks": {str(r): v for r, v in results.items()}}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
