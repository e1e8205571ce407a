"""The `enn` subcommands that are more than one call: a stage as `dvc repro` runs it, a whole
flow, a study, the UIs."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from enn_core.config import RunConfig, redact_override
from enn_core.paths import Layout
from enn_core.runtime.external import LauncherEnv
from enn_core.stages import DISTRIBUTED_TRAIN, PREDICT, Flow, StageSpec
from flows import console
from flows.exits import ended_by
from flows.prefect_api import prefect_api
from flows.summary import Summary, left_to_rank0_node
from tasks.ui import ML_VIEW

if TYPE_CHECKING:
    from tasks.runner import FlowRecord, StageResult


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
    return f"{url}/#/experiments/{exp_id}?{ML_VIEW}"


def run_stage_command(
    spec: StageSpec, cfg: RunConfig, config: Path, layout: Layout, overrides: list[str]
) -> int:
    """One stage, as `dvc repro` runs it; `--set` overrides go into the pipeline's params.yaml
    once it succeeded (as `enn run --set` and `dvc exp run -S` do: the outputs and params.yaml
    agree; a failed run leaves the file as it was), never into a --config file
    (flows/params_file.py)."""
    from flows.params_file import mlflow_tags, once_lines, plan, summary_line, write_overrides
    from tasks.runner import execute_stage
    from tasks.session import job_group, pipeline_session

    launched = LauncherEnv.required() if cfg.runtime.launcher == "external" else None
    if launched is not None and launched.rank != 0:
        return worker_only(spec, cfg, layout, launched)
    group = job_group()
    if group and group.run_dirs:
        name = f"dvc repro ({spec.name})"
    elif group:  # a batch job's parent, which this stage may be the first to make (a SLURM
        # job whose stage-data was up to date): named as the job's `enn run` names it
        name = spec.flow
    else:
        name = f"enn {spec.name}"
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
    from tasks.runner import refuse_other_rank, run_work

    refuse_other_rank(spec, launched.rank)
    t0 = time.monotonic()
    ctx = make_context(cfg, layout, spec, f"{launched.run_id}-rank{launched.rank}")
    run_work(spec, cfg, ctx)
    print(
        f"{spec.name}: rank {launched.rank} done in {time.monotonic() - t0:.1f} s "
        f"(its records: {ctx.run_dir}); the process of global rank 0 publishes the outputs"
    )
    return 0


FlowPlan = tuple[Flow, RunConfig, Path, Layout]  # the flow, its config, its file, its layout


def run_flow_command(args: argparse.Namespace, cfg: RunConfig, config: Path, layout: Layout) -> int:
    """`enn run`: one flow, or `--flow both`: training, then prediction (its own params.yaml,
    the champion the training may just have registered) in this process, under one lock and
    one Prefect API (the Quick start pays the API's start once)."""
    from tasks.lock import pipeline_lock

    flows = (
        both_flows(args, cfg, config, layout)
        if args.flow == "both"
        else [(args.flow, cfg, config, layout)]
    )
    # the lock first: a second run fails fast, before Prefect starts
    with (
        pipeline_lock(layout.lock_file, f"enn run --flow {args.flow}"),
        prefect_api(layout, while_starting=lambda: _import_flows(flows, args.until)) as api,
    ):
        for flow, flow_cfg, flow_config, flow_layout in flows:
            code, record = _run_one_flow(args, flow, flow_cfg, flow_config, flow_layout, api)
            if code:
                return code
            if left_to_rank0_node(record):  # its model is published there, not yet here
                break
    return 0


def both_flows(
    args: argparse.Namespace, cfg: RunConfig, config: Path, layout: Layout
) -> list[FlowPlan]:
    """`--flow both`: the training flow on `config` (with --set), then the prediction flow on
    the prediction pipeline's params.yaml as `enn run --flow prediction` loads it. Refused where
    one command cannot run both: --until (which flow's stage?), or a prediction config whose
    work directory or MLflow store is not the training run's (this process is contained in
    one: tasks/env.py), or whose tracking would not find the champion this training registers
    (`tracking.enabled`, `tracking.registered_model`)."""
    from enn_core.config import load_config
    from enn_core.errors import ConfigError
    from enn_core.paths import pipeline_params, project_root
    from flows.params_file import run_overrides

    if args.until:
        raise ConfigError(
            f"--until {args.until} with --flow both: --until stops one flow; run "
            "`enn run --until STAGE` or `enn run --flow prediction --until STAGE` "
            "(docs/getting-started.md)"
        )
    pred_config = pipeline_params("prediction", layout.root)
    pred_cfg = load_config(pred_config, run_overrides(pred_config, []))
    pred_layout = Layout.for_root(project_root(pred_config), pred_cfg.runtime.work_dir)
    # one process, one contained environment (tasks/env.py), and the prediction must find
    # the champion this training registers
    for key, mine, theirs in (
        ("runtime.work_dir", layout.work, pred_layout.work),
        ("tracking.uri", cfg.tracking.uri, pred_cfg.tracking.uri),
        ("tracking.enabled", cfg.tracking.enabled, pred_cfg.tracking.enabled),
        (
            "tracking.registered_model",
            cfg.tracking.registered_model,
            pred_cfg.tracking.registered_model,
        ),
    ):
        if mine != theirs:
            raise ConfigError(
                f"--flow both: {key} is {str(mine)!r} for the training run and "
                f"{str(theirs)!r} in {pred_config}; make them agree, or run `enn run`, then "
                "`enn run --flow prediction`"
            )
    return [("training", cfg, config, layout), ("prediction", pred_cfg, pred_config, pred_layout)]


def _run_one_flow(
    args: argparse.Namespace, flow: Flow, cfg: RunConfig, config: Path, layout: Layout, api: str
) -> tuple[int, FlowRecord]:
    """One flow run and its closing summary (also when it stops): its exit code (130 when it
    was cancelled) and its record."""
    from prefect.exceptions import CancelledRun

    from flows.training import preloaded, recorded_flow

    overrides = [] if args.flow == "both" and flow == "prediction" else args.overrides
    summary = Summary(layout, cfg, flow, args.until, api)
    with recorded_flow() as record:
        try:
            if flow == "prediction":
                from flows.prediction import prediction

                with preloaded(config, overrides, cfg):
                    prediction(
                        config=str(config), overrides=overrides, model=args.model, until=args.until
                    )
            else:
                from flows.training import training

                with preloaded(config, overrides, cfg):
                    training(config=str(config), overrides=overrides, until=args.until)
        except CancelledRun as e:
            summary.print(record, ended="cancelled")
            why = str(e).splitlines()[0] if str(e) else "the flow run was cancelled"
            print(f"cancelled: {why}", file=sys.stderr)
            return 130, record
        except BaseException as e:
            # what ran, what stopped, where to look; the error's one line (printed by
            # _main: `error: ...`, `interrupted`) stays the last line
            summary.print(record, ended=ended_by(e))
            raise
    summary.print(record)
    return 0, record


# What a flow run imports after its API answers, in the order it does: the flow's modules, the
# modules of the stages in the run that import torch in this process, and MLflow with its store.
# Imported while a temporary Prefect API starts, they take the other core: 2.8 s to an answering
# API with the flow's own modules (0.8 s of it), 3.5 s with these too, which cost 2.6 s more
# when imported after it (bench_quickstart).
FLOW_MODULES = {
    "training": "flows.training",
    "prediction": "flows.prediction",
    "tuning": "flows.tuning",  # optuna; the trials' torch is in their own processes
}
STAGE_MODULES = {
    DISTRIBUTED_TRAIN.name: "enn_core.train.stage",
    PREDICT.name: "enn_core.predict.stage",  # the prediction flow's predict: the same name
}
TRACKING_IMPORTS = ("mlflow", "mlflow.tracking")
LOCAL_STORE_IMPORTS = ("mlflow.store.tracking.sqlalchemy_store",)


def flow_imports(flow: str, cfg: RunConfig, until: str | None = None) -> list[str]:
    """The modules `_import_flow` imports: only the stages up to `until` (`--until stage-data`
    imports no torch); MLflow's local store only where the run's URI (the setting, else
    MLFLOW_TRACKING_URI, as the tracker reads it) is not a server."""
    from enn_core.stages import FLOWS, up_to

    names = [FLOW_MODULES[flow]]
    if flow in FLOWS:
        stages = up_to("prediction" if flow == "prediction" else "training", until)
        names += [STAGE_MODULES[s.name] for s in stages if s.name in STAGE_MODULES]
    if cfg.tracking.enabled:
        names += TRACKING_IMPORTS
        uri = cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri.startswith(("http://", "https://")):
            names += LOCAL_STORE_IMPORTS
    return names


def _import_flow(flow: str, cfg: RunConfig, until: str | None = None) -> None:
    """The flow's modules (prefect, the tasks, the stages, MLflow when it tracks): seconds of
    imports, done while a temporary Prefect API starts."""
    import importlib

    for name in flow_imports(flow, cfg, until):
        importlib.import_module(name)


def _import_flows(flows: list[FlowPlan], until: str | None) -> None:
    for flow, cfg, _, _ in flows:
        _import_flow(flow, cfg, until)


def tune_command(args: argparse.Namespace, cfg: RunConfig, config: Path, layout: Layout) -> int:
    """`enn tune`: the tuning flow on the local Prefect API; `--apply`: the best values into
    the config file."""
    if args.apply:
        from flows.tuning import apply_best

        for line in apply_best(cfg, config, args.overrides, layout):
            print(line, flush=True)
        return 0
    with prefect_api(layout, while_starting=lambda: _import_flow("tuning", cfg)):
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
