"""The worker entry for external launchers: torchrun, `srun torchrun` under SLURM, a Kubernetes
PyTorchJob (docs/scale-out.md).

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend enn-c10d \\
        --rdzv-endpoint node1:29400 --rdzv-id job42 --max-restarts 1 \\
        -m flows.worker [distributed-train] [--config params.yaml] [--set K=V ...]
    torchrun ... -m flows.worker predict [--pipeline prediction] --set predict.parts_dir=/shared/p

Every process the launcher starts is one worker of the stage: distributed-train, or predict
(each rank predicts its share of the parts into `predict.parts_dir`; rank 0 assembles). The
stage runs with `runtime.launcher=external` and the node count, workers per node, restart
limit and job id the launcher decided added as overrides, so the run records them. Global
rank 0 runs `enn <stage>` as on one machine: the pipeline lock of its work directory, its
MLflow run, the outputs published, `--set` values recorded in params.yaml (not a shared folder
outside the checkout, flows/params_file.py: the run is then its own). Every other rank
runs the stage's work only (flows.commands.worker_only): its logs and heartbeat in
`work/runs/<job id>-rank<r>/` of its node; no lock, no MLflow run, nothing published. The
launcher restarts the workers (`--max-restarts`): a restarted training resumes from the
newest committed checkpoint in `checkpoint.dir`, a restarted prediction reuses the parts
already written; every node must share both folders.
"""

from __future__ import annotations

import argparse
import sys

from enn_core.errors import EnnError
from enn_core.runtime.external import LauncherEnv
from enn_core.stages import DISTRIBUTED_TRAIN, PREDICT
from flows import cli, exits

# the stages that run as ranks of a launched job
STAGES = (DISTRIBUTED_TRAIN.name, PREDICT.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m flows.worker",
        description="One worker of a stage (distributed-train or predict), started by torchrun "
        "(docs/scale-out.md).",
    )
    p.add_argument(
        "stage",
        nargs="?",
        choices=STAGES,
        default=STAGES[0],
        help="The stage every rank runs (default: distributed-train).",
    )
    p.add_argument(
        "--pipeline",
        choices=["training", "prediction"],
        default="training",
        help="predict: which pipeline's version (prediction reads prediction/params.yaml).",
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
    config = args.config or ("prediction/params.yaml" if args.pipeline == "prediction" else None)
    return cli.main(
        [
            args.stage,
            *(["--pipeline", args.pipeline] if args.stage == PREDICT.name else []),
            *(["--config", config] if config else []),
            *(part for o in sets for part in ("--set", o)),
            *(["-v"] if args.verbose else []),
        ]
    )


if __name__ == "__main__":
    exits.exit_with(main())  # a stopped worker ends as `enn` does
