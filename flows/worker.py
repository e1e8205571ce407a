"""The worker entry for external launchers: torchrun, `srun torchrun` under SLURM, a Kubernetes
PyTorchJob (docs/scale-out.md).

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend enn-c10d \\
        --rdzv-endpoint node1:29400 --rdzv-id job42 --max-restarts 1 \\
        -m flows.worker [--config params.yaml] [--set checkpoint.dir=/shared/ckpt ...]

Every process the launcher starts is one training worker of the distributed-train stage
(`runtime.launcher=external`, with the node count, workers per node, restart limit and job
id the launcher decided added as overrides, so the run records them). Global rank 0 runs
`enn distributed-train` as on one machine: the pipeline lock of its work directory, its
MLflow run, the outputs published, `--set` values recorded in params.yaml. Every other rank
runs the stage's work only (flows.cli.worker_only): its logs and heartbeat in
`work/runs/<job id>-rank<r>/` of its node; no lock, no MLflow run, nothing published. The
launcher restarts the workers (`--max-restarts`); a restarted job resumes from the newest
committed checkpoint in `checkpoint.dir`, which every node must share.
"""

from __future__ import annotations

import argparse
import sys

from enn_core.errors import EnnError
from enn_core.runtime.external import LauncherEnv
from flows import cli


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m flows.worker",
        description="One worker of distributed-train, started by torchrun (docs/scale-out.md).",
    )
    p.add_argument("--config", default=None, help="Config file (default: params.yaml).")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("-v", "--verbose", action="store_true", help="Debug logging.")
    args = p.parse_args(argv)
    try:
        launched = LauncherEnv.required()
    except EnnError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    sets = [*args.overrides, *launched.overrides()]
    return cli.main(
        [
            "distributed-train",
            *(["--config", args.config] if args.config else []),
            *(part for o in sets for part in ("--set", o)),
            *(["-v"] if args.verbose else []),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
