"""`enn`'s argument parser: one subcommand per stage, `enn run` for a whole flow, and the
tools (tune, gc, deploy, serve, doctor, ui)."""

from __future__ import annotations

import argparse
import textwrap

from enn_core.errors import exit_codes
from enn_core.stages import FLOWS, PREDICTION, TRAINING
from flows.report import stage_description

COMMON_EPILOG = (
    "Config: defaults -> params.yaml -> --set overrides (docs/config.md lists every key). "
    "Outputs: outputs/<stage>/; run directories, MLflow and Prefect state: work/."
)

# The page of docs/ that covers each command; its help ends with it (a test checks the files).
# (A stage's page is its spec's `docs`.)
PAGES = {
    "enn": "docs/getting-started.md",
    **{spec.name: spec.docs for spec in TRAINING},
    "run": "docs/getting-started.md",
    "tune": "docs/tuning.md",
    "gc": "docs/tuning.md",
    "deploy": "docs/getting-started.md",
    "serve": "docs/serving.md",
    "doctor": "docs/troubleshooting.md",
    "ui": "docs/getting-started.md",
}


def epilog(command: str, text: str = COMMON_EPILOG) -> str:
    """`text`, then the page that covers `command` (the last line of its help)."""
    return f"{text}\n\nDocs: {PAGES[command]} (every page: README.md)."


class _Paragraphs(argparse.HelpFormatter):
    """Wraps each paragraph of a description or epilog on its own (a blank line between)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(
            super(_Paragraphs, self)._fill_text(t, width, indent) for t in text.split("\n\n")
        )


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", default=None, help="Config file (default: params.yaml in the project root)."
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override one config value, e.g. --set train.epochs=3 (repeatable); recorded in "
        "the pipeline's params.yaml, never in a --config file (docs/getting-started.md).",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="Debug logging.")


def build_parser() -> argparse.ArgumentParser:
    # the list keeps its columns (a raw epilog), each entry wrapped to fit 100 columns
    codes = "\n".join(
        textwrap.fill(f"{code:>3}  {meaning}", 100, initial_indent="  ", subsequent_indent=" " * 7)
        for code, meaning in exit_codes().items()
    )
    parser = argparse.ArgumentParser(
        prog="enn",
        description="ENN training-and-prediction pipeline.",
        epilog=epilog("enn", f"{textwrap.fill(COMMON_EPILOG, 100)}\n\nexit codes:\n{codes}"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    variants = {s.name: s for s in PREDICTION}
    for spec in TRAINING:
        p = sub.add_parser(
            spec.name,
            help=spec.help,
            description=stage_description(spec, variants.get(spec.name)),
            epilog=epilog(spec.name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _common(p)
        if spec.name in variants:
            p.add_argument(
                "--pipeline",
                choices=list(FLOWS),
                default="training",
                help="Which pipeline's version of the stage to run "
                "(prediction/dvc.yaml passes prediction).",
            )
    p = sub.add_parser(
        "run",
        help="Run a whole flow through Prefect (DVC skips stages that are up to date).",
        description="Run a whole flow through Prefect on the local API (or PREFECT_API_URL). "
        "--set values of the pipeline's sections go into params.yaml first (only the keys that "
        "change), as `dvc exp run -S` does; a --config file is never written, and a path "
        "outside the project keeps the whole run out of the tracked file and of DVC.",
        epilog=epilog("run"),
        formatter_class=_Paragraphs,
    )
    _common(p)
    p.add_argument(
        "--flow",
        choices=["training", "prediction", "both"],
        default="training",
        help="training: the seven stages on params.yaml; prediction: stage-data (features-only) -> "
        "predict -> collapse-check on prediction/params.yaml; both: training, then prediction "
        "(with the champion) in one process and one Prefect API, as scripts/demo.sh runs them "
        "(--set and --config go to training).",
    )
    p.add_argument(
        "--until", default=None, metavar="STAGE", help="Stop after this stage (default: run all)."
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="REF",
        help="prediction flow: a consolidated checkpoint path or models:/NAME@ALIAS "
        "(default: predict.model).",
    )
    p = sub.add_parser(
        "tune",
        help="Search hyperparameters with Optuna (the tune: section): each trial runs "
        "prepare-checkpoint and distributed-train on the training and validation rows.",
        description="Runs (or resumes) the study the config's tune: section declares, as the "
        "Prefect flow `tuning`: trials side by side up to the cores (or GPUs), pruned from their "
        "per-epoch validation loss, each a child run of the MLflow run `tune <study>`; the study "
        "lives in work/tune/<study>.db, or in tune.storage's database, which several hosts' `enn "
        "tune` share (docs/scale-out.md). --set overrides apply to every trial and are not "
        "written into the config file. --apply writes the best values into the config file "
        "instead.",
        epilog=epilog("tune"),
        formatter_class=_Paragraphs,
    )
    _common(p)
    p.add_argument(
        "--apply",
        action="store_true",
        help="Write the study's best values into the config file (params.yaml or --config), "
        "so `dvc repro` trains them; runs no trial.",
    )
    p = sub.add_parser(
        "gc",
        help="Remove old checkpoints, finished trials' folders and failed runs' artifacts "
        "(the gc: section), never what dvc.lock or a registered version points at.",
        description="Says what it removed and the bytes freed; --dry-run only lists.",
        epilog=epilog("gc"),
        formatter_class=_Paragraphs,
    )
    _common(p)
    p.add_argument("--dry-run", action="store_true", help="List what would go; remove nothing.")
    p = sub.add_parser(
        "deploy",
        help="Serve the training flow on its cron schedule and the prediction flow on demand.",
        description="Starts `prefect server start` on 127.0.0.1 (a free port, unless "
        "PREFECT_API_URL is set) and serves both deployments until Ctrl-C.",
        epilog=epilog("deploy"),
        formatter_class=_Paragraphs,
    )
    _common(p)
    p = sub.add_parser(
        "serve",
        help="Serve a registered model (this task's champion) with MLflow's scoring server on "
        "127.0.0.1, over this project's store.",
        description="Runs `mlflow models serve --env-manager local` over the project's MLflow "
        "store and prints its URL and a JSON and a CSV request that work as printed. Ctrl-C "
        "stops it.",
        epilog=epilog("serve"),
        formatter_class=_Paragraphs,
    )
    _common(p)
    p.add_argument(
        "--model",
        default=None,
        metavar="REF",
        help="models:/NAME@ALIAS or models:/NAME/VERSION (default: this task's champion).",
    )
    p.add_argument("--port", type=int, default=None, help="Port (default 5001; 0: a free one).")
    p = sub.add_parser(
        "doctor",
        help="Check the execution path layer by layer (data, model, kernels, precision, "
        "workers, distributed, checkpoints, export): ok / warn / fail with the fix.",
        description="Each line: ok, warn or fail, the measured detail and the fix. "
        "Exit 1 on any fail.",
        epilog=epilog("doctor"),
        formatter_class=_Paragraphs,
    )
    _common(p)
    p.add_argument(
        "--quick", action="store_true", help="Skip the slow checks (torch.compile, torch.export)."
    )
    p.add_argument("--json", action="store_true", help="JSON for machines instead of the table.")
    p.add_argument(
        "--only", default=None, metavar="LAYERS", help="Comma-separated layers, e.g. data,model."
    )
    p = sub.add_parser(
        "ui",
        help="Start the MLflow UI and the Prefect UI over the project's stores, on 127.0.0.1.",
        description="The MLflow UI (mlflow server over work/mlflow, job execution off: runs, "
        "metrics, registered models) and the Prefect UI (prefect server start over work/prefect: "
        "flow runs, task runs, their logs and artifacts), on deploy.host; prints both URLs. "
        "While it runs, `enn run` reports its flow runs to this Prefect server. Ctrl-C stops both.",
        epilog=epilog("ui"),
        formatter_class=_Paragraphs,
    )
    _common(p)
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="The MLflow UI's port (default: deploy.mlflow_port; the Prefect UI's: "
        "deploy.prefect_port).",
    )
    return parser
