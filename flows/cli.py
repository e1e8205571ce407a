"""`enn`: one subcommand per stage, `enn run` for a whole flow.

    enn stage-data [--config params.yaml] [--set data.source=workbook ...]
    enn run [--flow training] [--set train.epochs=3]

Each stage subcommand runs the same function as its Prefect task (tasks/runner.py); this is
what `dvc repro` calls. Errors print one line and exit non-zero; the code says which kind
(`enn_core.errors.exit_codes()`, printed by `enn --help`).

The command line is split by what changes together: flows/parser.py (arguments and help),
flows/commands.py (the subcommands), flows/summary.py (`enn run`'s closing summary),
flows/prefect_api.py (the API a flow reports to) and flows/exits.py (SIGTERM as Ctrl-C, and
how a stopped command ends). This module loads the config and dispatches.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from enn_core.config import RunConfig
from enn_core.errors import ConfigError, EnnError, TransientError, no_space_behind, out_of_memory
from enn_core.paths import ENV_WORK_DIR, Layout, pipeline_params, project_root
from enn_core.stages import TRAINING, Flow, lookup
from flows import console
from flows.commands import run_flow_command, run_stage_command, tune_command, ui_command
from flows.exits import Terminated, exit_with, sigterm_as_interrupt, terminating
from flows.params_file import is_pipeline_params
from flows.parser import build_parser
from flows.refusals import refused
from flows.report import stopped

TERMINATED = "terminated (SIGTERM): workers stopped, lock released"
SERVERS = frozenset({"ui", "deploy", "serve"})  # commands that hold servers, not the lock


def terminated(args: argparse.Namespace) -> str:
    """What SIGTERM ended: a pipeline command's workers and lock, or a server command's
    servers (stopped with it, in their own process groups)."""
    servers = args.command in SERVERS
    return stopped("terminated (SIGTERM): its servers stopped" if servers else TERMINATED, args)


def _config_path(args: argparse.Namespace) -> Path:
    """The run's config file: --config, else the asked pipeline's params.yaml from any folder of
    the project (`enn stage-data --pipeline prediction` from the root, or `enn run` from
    prediction/, each does its own pipeline's work). A pipeline's own params.yaml given to the
    other pipeline's stage is refused: its outputs would be the other pipeline's."""
    flow = getattr(args, "flow", None) or getattr(args, "pipeline", None) or "training"
    flow = "training" if flow == "both" else flow  # --flow both: --config is training's
    if not args.config:
        return pipeline_params(flow)
    config = Path(args.config).resolve()
    if args.command in {"run", *STAGE_NAMES} and is_pipeline_params(config):
        other = "prediction" if flow == "training" else "training"
        if config == pipeline_params(other, config.parent) != pipeline_params(flow, config.parent):
            raise ConfigError(
                f"--config {args.config} is the {other} pipeline's params.yaml, and this is the "
                f"{flow} pipeline's {args.command}: leave --config out (it finds "
                f"{pipeline_params(flow, config.parent)}) or pass --pipeline {other}"
            )
    return config


STAGE_NAMES = frozenset(s.name for s in TRAINING)


def dispatch(args: argparse.Namespace, cfg: RunConfig, config: Path, layout: Layout) -> int:
    if args.command == "run":
        return run_flow_command(args, cfg, config, layout)
    if args.command == "deploy":
        from flows.deploy import deploy

        return deploy(cfg, config, layout.root / "prediction" / "params.yaml")
    if args.command == "doctor":
        from enn_core.doctor import main as doctor_main

        return doctor_main(cfg, layout, quick=args.quick, as_json=args.json, only=args.only)
    if args.command == "ui":
        return ui_command(cfg, layout, args.port)
    if args.command == "serve":
        from flows.serve import serve_command

        return serve_command(cfg, layout, args.model, args.port)
    if args.command == "tune":
        return tune_command(args, cfg, config, layout)
    if args.command == "gc":
        from flows.gc import gc_command

        return gc_command(cfg, config, layout, dry_run=args.dry_run)
    flow: Flow = getattr(args, "pipeline", "training")
    return run_stage_command(lookup(args.command, flow), cfg, config, layout, args.overrides)


def main(argv: list[str] | None = None) -> int:
    with sigterm_as_interrupt():
        return _main(argv)


def entry() -> None:
    """The `enn` command: `main`, then the process ends with its code (`exit_with`)."""
    exit_with(main())


def _log_name(args: argparse.Namespace) -> str:
    """The log file's name after the command (`run-training`, `validate`)."""
    if args.command == "run":
        return f"run-{getattr(args, 'flow', None) or 'training'}"
    return str(args.command)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    console.setup(None, args.command, verbose=args.verbose)  # the log file once work/ is known
    try:
        config = _config_path(args)
    except ConfigError as e:
        print(console.one_line(e), file=sys.stderr)
        return e.exit_code
    root = project_root(config)  # an overlay under configs/ runs in the project, not in configs/
    disks = [root, os.environ.get(ENV_WORK_DIR) or root / "work"]  # where a full disk is named
    try:
        from enn_core.config import load_config
        from flows.params_file import run_overrides
        from tasks.env import contain, project_layout

        # The config, loaded and validated once for this process (bad config fails before
        # any work); then the environment, before anything imports prefect or mlflow.
        args.overrides = run_overrides(config, args.overrides)  # project paths relative
        cfg = load_config(config, args.overrides)
        layout = contain(project_layout(root, cfg.runtime.work_dir), tracking_uri=cfg.tracking.uri)
        console.setup(layout.work / "logs", _log_name(args), verbose=args.verbose)
        return dispatch(args, cfg, config, layout)
    except EnnError as e:
        if isinstance(e, TransientError):  # a server or worker that died of a full disk
            e = no_space_behind(e, disks) or e
        print(console.one_line(e), file=sys.stderr)
        return e.exit_code
    except Exception as e:  # a full disk, refused credentials, whichever library met it first
        # out of memory outside a stage (doctor, serve, tune's own process): the stages say
        # theirs with the settings that lower it; here there is none to name
        oom = out_of_memory(e, f"enn {args.command}", ())
        full = no_space_behind(e, disks) or refused(e) or oom
        if full is None:
            raise
        print(console.one_line(full), file=sys.stderr)
        return full.exit_code
    except Terminated:
        print(terminated(args), file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        if terminating():  # SIGTERM, re-raised as an interrupt by a library's loop (Optuna's)
            print(terminated(args), file=sys.stderr)
            return 143
        print(stopped("interrupted", args), file=sys.stderr)
        return 130


if __name__ == "__main__":
    entry()
