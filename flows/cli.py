"""`enn`: one subcommand per stage, `enn run` for a whole flow.

    enn stage-data [--config params.yaml] [--set data.source=workbook ...]
    enn run [--flow training] [--set train.epochs=3]

Each stage subcommand runs the same function as its Prefect task (tasks/runner.py); this is
what `dvc repro` calls. Errors print one line and exit non-zero; the code says which kind
(`enn_core.errors.exit_codes()`, printed by `enn --help`).

SIGTERM takes Ctrl-C's path (`Terminated` is a KeyboardInterrupt): workers are killed, the
lock released, MLflow runs closed, Prefect's temporary server stopped. Without this, Prefect's
flow engine re-sends SIGTERM to the default handler, and the process dies mid-cleanup.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from enn_core.config import RunConfig, redact_override
from enn_core.errors import EnnError, TransientError, exit_codes, no_space_behind
from enn_core.paths import ENV_WORK_DIR, Layout, find_root, project_root
from enn_core.runtime.external import LauncherEnv
from enn_core.stages import (
    FLOWS,
    PREDICTION,
    STAGE_DATA,
    TRAINING,
    VALIDATE,
    Flow,
    StageSpec,
    lookup,
    up_to,
)
from flows import console
from flows.report import again, predictions_lines, results_part, stage_description

if TYPE_CHECKING:
    from tasks.runner import FlowRecord, StageResult

COMMON_EPILOG = (
    "Config: defaults -> params.yaml -> --set overrides (docs/config.md lists every key). "
    "Outputs: outputs/<stage>/; run directories, MLflow and Prefect state: work/."
)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: everything that cleans up after Ctrl-C runs."""


_terminating = threading.Event()


def _on_sigterm(signum: int, frame) -> None:
    if _terminating.is_set():  # a second SIGTERM must not cut the cleanup short (SIGKILL forces)
        print("SIGTERM again: still stopping workers and releasing the lock", file=sys.stderr)
        return
    _terminating.set()
    raise Terminated()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While the block runs (main thread only), SIGTERM raises `Terminated` like Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _terminating.clear()
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
        "the pipeline's params.yaml, never in a --config file (README, Running it).",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="Debug logging.")


def build_parser() -> argparse.ArgumentParser:
    codes = "\n".join(f"  {code:>3}  {meaning}" for code, meaning in exit_codes().items())
    parser = argparse.ArgumentParser(
        prog="enn",
        description="ENN training-and-prediction pipeline.",
        epilog=f"{COMMON_EPILOG}\n\nexit codes:\n{codes}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    variants = {s.name: s for s in PREDICTION}
    for spec in TRAINING:
        p = sub.add_parser(
            spec.name,
            help=spec.help,
            description=stage_description(spec, variants.get(spec.name)),
            epilog=COMMON_EPILOG,
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
    )
    _common(p)
    p.add_argument(
        "--flow",
        choices=["training", "prediction"],
        default="training",
        help="training: the seven stages on params.yaml; prediction: stage-data (features-only) -> "
        "predict -> collapse-check on prediction/params.yaml.",
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
    )
    _common(p)
    p.add_argument("--dry-run", action="store_true", help="List what would go; remove nothing.")
    p = sub.add_parser(
        "deploy",
        help="Serve the training flow on its cron schedule and the prediction flow on demand.",
        description="Starts `prefect server start` on 127.0.0.1 (a free port, unless "
        "PREFECT_API_URL is set) and serves both deployments until Ctrl-C.",
    )
    _common(p)
    p = sub.add_parser(
        "serve",
        help="Serve a registered model (this task's champion) with MLflow's scoring server on "
        "127.0.0.1, over this project's store.",
        description="Runs `mlflow models serve --env-manager local` over the project's MLflow "
        "store and prints its URL and a JSON and a CSV request that work as printed. Ctrl-C "
        "stops it.",
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


def _config_path(args: argparse.Namespace) -> Path:
    if args.config:
        return Path(args.config).resolve()
    if getattr(args, "flow", None) == "prediction":
        return find_root() / "prediction" / "params.yaml"
    return find_root() / "params.yaml"


def ui_command(cfg: RunConfig, layout: Layout, port: int | None) -> int:
    """The MLflow UI and the Prefect UI over this project's stores, on loopback, until Ctrl-C;
    `enn run` meanwhile reports its flow runs to this Prefect server (work/ui.json)."""
    from flows.servers import mlflow_server, prefect_server
    from tasks.ui import announce_ui

    uri = cfg.tracking.uri or layout.mlflow_uri
    logs = layout.work / "logs"
    with (
        mlflow_server(
            uri,
            layout.mlflow_artifacts,
            cfg.deploy.host,
            cfg.deploy.mlflow_port if port is None else port,
            logs / "mlflow-server.log",
        ) as url,
        prefect_server(cfg.deploy.host, cfg.deploy.prefect_port, logs / "prefect-ui.log") as api,
    ):
        announce_ui(layout.work, api, url)
        print(f"MLflow UI: {experiment_url(url, cfg.tracking.experiment)}", flush=True)
        # the UI's own pages are client-side routes: its root is the address that loads
        print(f"Prefect UI: {api.removesuffix('/api')} (Ctrl-C stops both)", flush=True)
        import time

        while True:
            time.sleep(3600)


def experiment_url(url: str, experiment: str) -> str:
    """The experiment's run list in MLflow's model-training view (the UI otherwise opens in
    its GenAI view, a per-browser setting); the server's root before the first run."""
    import json
    import urllib.parse
    import urllib.request

    query = urllib.parse.urlencode({"experiment_name": experiment})
    try:
        with urllib.request.urlopen(
            f"{url}/api/2.0/mlflow/experiments/get-by-name?{query}", timeout=10
        ) as r:
            exp_id = json.loads(r.read())["experiment"]["experiment_id"]
    except (OSError, ValueError, KeyError):
        return url
    return f"{url}/#/experiments/{exp_id}?workflowType=machine_learning"


def run_stage_command(
    spec: StageSpec, cfg: RunConfig, config: Path, layout: Layout, overrides: list[str]
) -> int:
    """One stage, as `dvc repro` runs it; `--set` overrides go into the pipeline's params.yaml
    once it succeeded (as `enn run --set` and `dvc exp run -S` do: the outputs and params.yaml
    agree; a failed run leaves the file as it was), never into a --config file
    (flows/params_file.py)."""
    from flows.params_file import mlflow_tags, once_lines, plan, summary_line, write_overrides
    from tasks.runner import execute_stage
    from tasks.session import dvc_group, pipeline_session

    launched = LauncherEnv.required() if cfg.runtime.launcher == "external" else None
    if launched is not None and launched.rank != 0:
        return worker_only(spec, cfg, layout, launched)
    group = dvc_group()
    name = f"dvc repro ({spec.name})" if group else f"enn {spec.name}"
    sets = plan(config, overrides)
    tags = mlflow_tags(sets)
    with pipeline_session(
        cfg, config, layout, name, group=group, specs=(spec,), tags=tags
    ) as session:
        result = execute_stage(spec, session)
        changes = write_overrides(config, sets.write)
        for line in [f"{sets.name()}: {c}" for c in changes] + once_lines(sets):
            logging.getLogger("enn").info("params: %s", line)
    if result.summary is not None and result.summary.node_only:  # another node publishes
        print(f"{spec.name}: done in {result.seconds:.1f} s; {published_elsewhere(result)}")
    else:
        print(f"{spec.name}: done in {result.seconds:.1f} s -> {spec.output_dir(layout)}")
    said = summary_line(sets, changes)
    if said:
        print(said)
    return 0


def published_elsewhere(result: StageResult) -> str:
    """A node that did not get global rank 0: what it ran (when its summary says), and who
    publishes."""
    record = getattr(result.summary, "record", None) or {}
    ranks = record.get("node_ranks")
    ran = f"this node ran ranks {ranks}; " if ranks else ""
    return f"{ran}the node of global rank 0 publishes the outputs"


def worker_only(spec: StageSpec, cfg: RunConfig, layout: Layout, launched: LauncherEnv) -> int:
    """A worker other than global rank 0 under an external launcher (flows/worker.py): the
    stage's work only; rank 0's process holds the lock, records the run and publishes."""
    from enn_core.stage import make_context
    from tasks.runner import refuse_other_rank

    refuse_other_rank(spec, launched.rank)
    t0 = time.monotonic()
    ctx = make_context(cfg, layout, spec, f"{launched.run_id}-rank{launched.rank}")
    spec.work(cfg, ctx)
    print(
        f"{spec.name}: rank {launched.rank} done in {time.monotonic() - t0:.1f} s "
        f"(logs: {ctx.run_dir / 'logs'}); the process of global rank 0 publishes the outputs"
    )
    return 0


@contextlib.contextmanager
def prefect_api(layout: Layout) -> Iterator[str]:
    """The Prefect API a flow run reports to: PREFECT_API_URL when set, else a temporary one
    that enn starts in its own session (a terminal's Ctrl-C must not kill it mid-run) and
    stops when it exits. Set before prefect is imported, which reads it then."""
    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    from flows.servers import temporary_prefect_api
    from tasks.ui import running_ui

    ui = running_ui(layout.work)
    if ui is not None:  # `enn ui` serves this project's Prefect database: report to it
        logging.getLogger("enn").info(
            "Prefect API: %s (enn ui's; the run shows at %s)",
            ui["prefect_api"],
            ui["prefect_api"].removesuffix("/api"),
        )
        os.environ["PREFECT_API_URL"] = ui["prefect_api"]
        yield ui["prefect_api"]
        return

    api = temporary_prefect_api(layout.work / "logs" / "prefect-api.log")
    logging.getLogger("enn").info("Prefect API: %s (temporary: it stops with this run)", api)
    os.environ["PREFECT_API_URL"] = api
    yield api


def run_flow_command(args: argparse.Namespace, cfg: RunConfig, config: Path, layout: Layout) -> int:
    from tasks.lock import pipeline_lock

    flow, overrides = args.flow, args.overrides
    # the lock first: a second run fails fast, before Prefect starts
    with pipeline_lock(layout.lock_file, f"enn run --flow {flow}"), prefect_api(layout) as api:
        from prefect.exceptions import CancelledRun

        from flows.training import preloaded, recorded_flow

        summary = Summary(layout, cfg, flow, args.until, api)
        with recorded_flow() as record:
            try:
                if flow == "prediction":
                    from flows.prediction import prediction

                    with preloaded(config, overrides, cfg):
                        prediction(
                            config=str(config),
                            overrides=overrides,
                            model=args.model,
                            until=args.until,
                        )
                else:
                    from flows.training import training

                    with preloaded(config, overrides, cfg):
                        training(config=str(config), overrides=overrides, until=args.until)
            except CancelledRun as e:
                summary.print(record, ended="cancelled")
                why = str(e).splitlines()[0] if str(e) else "the flow run was cancelled"
                print(f"cancelled: {why}", file=sys.stderr)
                return 130
            except BaseException as e:
                # what ran, what stopped, where to look; the error's one line (printed by
                # _main: `error: ...`, `interrupted`) stays the last line
                summary.print(record, ended=ended_by(e))
                raise
    summary.print(record)
    return 0


def tune_command(args: argparse.Namespace, cfg: RunConfig, config: Path, layout: Layout) -> int:
    """`enn tune`: the tuning flow on the local Prefect API; `--apply`: the best values into
    the config file."""
    if args.apply:
        from flows.tuning import apply_best

        for line in apply_best(cfg, config, args.overrides, layout):
            print(line, flush=True)
        return 0
    with prefect_api(layout):
        from flows.training import preloaded
        from flows.tuning import tuning

        with preloaded(config, args.overrides, cfg):
            out = tuning(config=str(config), overrides=args.overrides)
    best = out.get("best")
    if best is None:
        print(f"study {out['study']}: {out['trials']} trial(s), none complete", flush=True)
    else:
        from tasks.tuning.study import shown

        values = shown(best)
        print(
            f"study {out['study']}: best trial {out['best_trial']} "
            f"({cfg.tune.metric} {out['best_value']:.4g}): {values}",
            flush=True,
        )
        again = [f"--config {args.config}"] if args.config else []
        again += [
            f"--set {redact_override(o)}"
            for o in args.overrides
            if o.startswith(("tune.study=", "tune.storage="))
        ]
        print(" ".join(["apply: enn tune --apply", *again]), flush=True)
    if args.overrides:  # as every --set: the config file keeps its values (--apply writes)
        from flows.params_file import plan

        sets = plan(config, args.overrides)
        print(
            f"params: {sets.name()} unchanged "
            f"({' '.join(redact_override(o) for o in sets.run)} for this study's trials only)"
        )
    if console.LOG_FILE is not None:
        print(f"log: {console.LOG_FILE}")
    return 0


def ended_by(e: BaseException) -> str:
    """The stopped stage's status in the summary."""
    if isinstance(e, Terminated):
        return "terminated"
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    return "failed"


class Summary:
    """How a flow run went: each stage's status and time, the headline results against the naive
    predictors, the registered version and the champion decision, and where to look (the run's
    MLflow and Prefect pages when a UI serves them, the log file, the outputs)."""

    def __init__(
        self, layout: Layout, cfg: RunConfig, flow: Flow, until: str | None, prefect_api: str
    ) -> None:
        self.layout, self.cfg, self.flow, self.until = layout, cfg, flow, until
        self.prefect_api = prefect_api

    def print(self, record: FlowRecord, ended: str | None = None) -> None:
        for line in self.lines(record, ended):
            print(line, flush=True)

    def lines(self, record: FlowRecord, ended: str | None = None) -> list[str]:
        log = [f"log: {console.LOG_FILE}"] if console.LOG_FILE is not None else []
        if ended is not None and not record.results and record.running is None:
            return log  # stopped before any stage (a config error): its one line says it
        out = self.stage_lines(record, ended)
        out += [record.params] if record.params else []
        if ended is None:
            out += self.result_lines(record)
            out.append(
                f"outputs: {self.layout.outputs}/<stage>/ "
                f"(staged data: {self.layout.outputs / STAGE_DATA.name})"
            )
        return out + log + self.look_lines(record)

    def stage_lines(self, record: FlowRecord, ended: str | None) -> list[str]:
        """`validate   ran   0.7 s  executed`; a stopped run adds the stage it stopped (its
        status: failed, cancelled, interrupted, terminated) and the stages that did not run."""
        out = [
            f"{s:20s} {r.status:8s} {r.seconds:7.1f} s  {r.reason}"
            for s, r in record.results.items()
        ]
        if ended is None:
            return out + self.elsewhere_lines(record)
        if record.running is not None:
            took = time.monotonic() - record.running_since
            out.append(f"{record.running:20s} {ended:8s} {took:7.1f} s")
        try:
            planned = [s.name for s in up_to(self.flow, self.until)]
        except EnnError:
            planned = []
        done = {*record.results, record.running}
        out += [f"{name:20s} not run" for name in planned if name not in done]
        return out

    def elsewhere_lines(self, record: FlowRecord) -> list[str]:
        """On a node of a multi-node run without global rank 0: the stages it left to that
        node (flows.training.after_multinode stopped the flow here)."""
        if not any(r.summary is not None and r.summary.node_only for r in record.results.values()):
            return []
        planned = [s.name for s in up_to(self.flow, self.until)]
        return [
            f"{name:20s} not run  (the node of global rank 0 runs it)"
            for name in planned
            if name not in record.results
        ]

    def result_lines(self, record: FlowRecord) -> list[str]:
        out = []
        metrics = VALIDATE.output_dir(self.layout) / "metrics.json"
        if self.flow == "training" and VALIDATE.name in record.results and metrics.is_file():
            m = json.loads(metrics.read_text())
            splits = [results_part(m, split) for split in ("val", "test")]
            out.append("results: " + "; ".join(p for p in splits if p))
        out += [f"model: {r.registry.line()}" for r in record.results.values() if r.registry]
        if self.flow == "prediction":
            out += predictions_lines(self.layout)
        return out

    def look_lines(self, record: FlowRecord) -> list[str]:
        """The run's pages where a UI serves them; else how to start one."""
        from tasks.ui import mlflow_run_url, mlflow_ui

        out = []
        mlflow = mlflow_ui(self.cfg, self.layout.work) if record.mlflow_run_id else None
        if mlflow and record.mlflow_experiment_id and record.mlflow_run_id:
            url = mlflow_run_url(mlflow, record.mlflow_experiment_id, record.mlflow_run_id)
            out.append(f"look: MLflow run {url}")
        prefect = prefect_ui(self.prefect_api) if record.flow_run_id else None
        if prefect:
            out.append(f"look: Prefect flow run {prefect}/runs/flow-run/{record.flow_run_id}")
        hints = [] if out else ["enn ui (MLflow and Prefect)"]
        if self.flow == "training":  # the prediction pipeline publishes no DVC metrics
            hints.append("dvc metrics show")
        return out + ([f"look: {', '.join(hints)}"] if hints else [])


def prefect_ui(api: str) -> str | None:
    """The Prefect UI at the API's server (its root, where `prefect server start` serves it),
    or None: enn run's temporary API serves no UI (PREFECT_UI_ENABLED=0)."""
    import urllib.request

    base = api.rstrip("/").removesuffix("/api")
    try:
        with urllib.request.urlopen(f"{base}/", timeout=3) as r:  # noqa: S310 - the run's API
            html = r.status == 200 and "html" in r.headers.get("content-type", "")
    except (OSError, ValueError):
        return None
    return base if html else None


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


def wait_for_agents(timeout_s: float = 60.0) -> None:
    """Let stopped elastic agents (enn_core.runtime.launch's daemon threads "enn-agent-*")
    finish shutting down before the interpreter exits: a daemon thread still inside torch's
    C++ code at interpreter finalization is torn down there, which aborts the process
    ("terminate called without an active exception"). One SIGTERMed `enn run` under heavy
    load printed that at exit (1 of ~15); launch() waits only 10 s for its agent."""
    end = time.monotonic() + timeout_s
    for t in threading.enumerate():
        if t.name.startswith("enn-agent-") and t.is_alive():
            t.join(max(0.0, end - time.monotonic()))


STOPPED = (130, 143)  # interrupted or cancelled, terminated


def main(argv: list[str] | None = None) -> int:
    with sigterm_as_interrupt():
        try:
            return _main(argv)
        finally:
            wait_for_agents()


def entry() -> None:
    """The `enn` command: `main`, then the process ends with its code (`exit_with`)."""
    exit_with(main())


def exit_with(code: int) -> None:
    """End this process with `code`: a stopped command through `end_stopped`, any other as
    Python ends. Only for a process's entry point: in-process callers of `main` keep theirs."""
    if code in STOPPED:
        end_stopped(code)
    sys.exit(code)


def end_stopped(code: int) -> None:
    """End a stopped command without the interpreter's finalization. Everything of ours is
    done by then (workers stopped, lock released, MLflow runs ended, the last line printed),
    but a thread of torch's elastic agent or store that a stop cut short can still be inside
    C++ when finalization tears the interpreter down, which aborts the process: "terminate
    called without an active exception", SIGABRT (exit -6) instead of 143 (1 of ~15 SIGTERMed
    runs under load, even after `wait_for_agents`). So: what Python's exit runs first, in its
    order (threading's exit hooks, where Prefect sends its last logs, and the join of
    non-daemon threads; then atexit's: servers stopped, logs flushed), then `os._exit`."""
    with contextlib.suppress(Exception):
        getattr(threading, "_shutdown")()  # noqa: B009 - CPython's own first step at exit
    with contextlib.suppress(Exception):
        import atexit

        getattr(atexit, "_run_exitfuncs")()  # noqa: B009 - runs each hook once, then clears
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _log_name(args: argparse.Namespace) -> str:
    """The log file's name after the command (`run-training`, `validate`)."""
    if args.command == "run":
        return f"run-{getattr(args, 'flow', None) or 'training'}"
    return str(args.command)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    console.setup(None, args.command, verbose=args.verbose)  # the log file once work/ is known
    config = _config_path(args)
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
    except Exception as e:  # a full disk, whichever library it struck first: its one line
        full = no_space_behind(e, disks)
        if full is None:
            raise
        print(console.one_line(full), file=sys.stderr)
        return full.exit_code
    except Terminated:
        print(f"terminated (SIGTERM): workers stopped, lock released{again(args)}", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"interrupted{again(args)}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    entry()
