"""The training flow: the seven stages in order, each a Prefect task over one enn_core
function. DVC decides which stages are stale; stages that are up to date are skipped.

Run: `enn run` (or `python -m flows.training`). Parameters are typed: the config path and
`--set` overrides (the pipeline's into its params.yaml first, as `dvc exp run -S` does; never
into a --config file: flows/params_file.py).

Cancellation: `enn run` calls the flow function in its own process, where no Prefect runner
watches for a cancel (Prefect 3's FlowRunCancellingObserver lives in the Runner that spawns
flow-run processes; the in-process engine never re-reads its state). So `watch_cancellation`
polls the flow run's state; once it is Cancelling (UI, `prefect flow-run cancel`, the API)
it sets the stages' `ctx.cancel`, the launcher kills every worker, no further stage starts,
and the flow run ends Cancelled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from uuid import UUID

import httpx
from prefect import flow
from prefect.runtime import deployment, flow_run
from prefect.states import Cancelled, State

from enn_core.config import RunConfig, RuntimeConfig, load_config, redact_override
from enn_core.errors import EnnError
from enn_core.paths import project_root
from enn_core.stage import cancel_scope
from enn_core.stages import StageSpec, up_to
from flows import console
from flows.params_file import Recorded, mlflow_tags, recorded_overrides, run_overrides
from flows.prefect_api import host_in_name
from tasks import dvc_state
from tasks.env import PREFECT_CONSOLE_QUIET, TOOLS, contain, project_layout
from tasks.prefect_task import stage_task
from tasks.runner import FlowRecord, PipelineSession, StageResult
from tasks.session import batch_group, pipeline_session

# The job variables of a deployment on a work pool (docs/scale-out.md): the flow-run process
# starts with Prefect's console at WARNING, as `enn`'s own flow runs do, so Prefect's INFO lines
# (its deployment steps, "Beginning flow run") go to the Prefect UI's log, not the worker's
# terminal
POOL_JOB_VARIABLES = {"env": dict(PREFECT_CONSOLE_QUIET)}


class FlowRunCancelled(Exception):
    """The flow run was set to Cancelling through the Prefect API."""


@contextlib.contextmanager
def watch_cancellation(flow_run_id: str | None, poll_s: float = 1.0) -> Iterator[threading.Event]:
    """An event set (within ~`poll_s`) once the flow run is Cancelling or Cancelled in the API.

    A daemon thread with its own client polls the run's state until the block ends."""
    cancel, done = threading.Event(), threading.Event()
    if not flow_run_id:
        yield cancel
        return
    # Not under "enn": Prefect's API log handler (PREFECT_LOGGING_EXTRA_LOGGERS=enn) refuses
    # records from a thread outside the flow run's context. The flow logs the cancel itself.
    log = logging.getLogger("flows.cancel")

    def poll() -> None:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            while not done.wait(poll_s):
                try:
                    state = client.read_flow_run(UUID(flow_run_id)).state
                except httpx.HTTPError as e:  # an API hiccup: the next poll tries again
                    log.debug("cancel watcher: reading flow run %s failed: %s", flow_run_id, e)
                    continue
                if state is not None and (state.is_cancelling() or state.is_cancelled()):
                    log.info(
                        "flow run %s is %s: stopping the running stage's workers",
                        flow_run_id,
                        state.name,
                    )
                    cancel.set()
                    return

    watcher = threading.Thread(target=poll, name=f"enn-cancel-watch-{flow_run_id[:8]}", daemon=True)
    watcher.start()
    try:
        yield cancel
    finally:
        done.set()
        watcher.join(5.0)


_PRELOADED: ContextVar[tuple[Path, tuple[str, ...], RunConfig] | None] = ContextVar(
    "enn_preloaded", default=None
)


_RECORD: ContextVar[FlowRecord | None] = ContextVar("enn_flow_record", default=None)


@contextlib.contextmanager
def recorded_flow() -> Iterator[FlowRecord]:
    """Flows called inside this block (in this process) record their stages in the record."""
    record = FlowRecord()
    token = _RECORD.set(record)
    try:
        yield record
    finally:
        _RECORD.reset(token)


@contextlib.contextmanager
def preloaded(config: Path, overrides: list[str], cfg: RunConfig) -> Iterator[None]:
    """Flows called inside this block use `cfg` (which `enn run` loaded and validated from
    `config` with `overrides`) instead of loading it again: once per process."""
    token = _PRELOADED.set((Path(config).resolve(), tuple(overrides), cfg))
    try:
        yield
    finally:
        _PRELOADED.reset(token)


def load_once(path: Path, overrides: list[str]) -> RunConfig:
    """The run's config: the one `preloaded` holds for `path` and these `overrides`, else
    loaded (and validated) here (a flow that adds an override, as the prediction flow's
    `--model PATH` adds predict.model, gets a config that has it)."""
    held = _PRELOADED.get()
    if held is not None and held[0] == path and held[1] == tuple(overrides):
        return held[2]
    return load_config(path, overrides)


def run_stages(
    name: str, config: str, overrides: list[str] | None, stages: tuple[StageSpec, ...]
) -> dict[str, StageResult] | State:
    """Run `stages` in order in one pipeline session; a Cancelled state if the run was cancelled
    (a run with nothing to do records no MLflow run: `_run_recorded`)."""
    logger = logging.getLogger("enn.flow")  # console, log file and (extra logger) Prefect
    path = Path(config).resolve()
    overrides = run_overrides(path, list(overrides or []))  # project paths relative
    cfg = load_once(path, overrides)
    recorded: Recorded | None = None
    try:
        deployed = deployment.get_id() is not None  # a deployment's run: its overrides its own
        with recorded_overrides(path, overrides, logger, deployed) as recorded:
            return _run_recorded(name, path, cfg, stages, recorded, logger)
    finally:  # the closing summary says what the file holds now: restored after a failure
        if recorded is not None and recorded.restored and (record := _RECORD.get()) is not None:
            record.params = recorded.summary()


@contextlib.contextmanager
def flow_console(config: str, overrides: list[str] | None, name: str) -> Iterator[None]:
    """A flow run's console: in a process `enn` did not start (`enn deploy`'s runs, a Prefect
    worker's), the console and log file `enn run` has (the project's lines, the epoch lines
    included; known noise in the log file only), and an enn error as the one line `enn run`
    prints (Prefect's account of it, with its traceback, goes to the log file). Under `enn
    run`, which set them up already, nothing changes."""
    path = Path(config).resolve()
    try:
        loaded = load_once(path, list(overrides or []))
        work_dir, tracking_uri = loaded.runtime.work_dir, loaded.tracking.uri
    except EnnError:  # the error is said below, in the default log
        work_dir, tracking_uri = RuntimeConfig().work_dir, ""
    # the tools' settings before anything of this flow imports mlflow (the prediction flow
    # downloads its model first): `contain` warned "called after importing ['mlflow']"
    layout = contain(
        project_layout(project_root(path), work_dir), groups=(TOOLS,), tracking_uri=tracking_uri
    )
    own = console.for_flow_run(layout.work / "logs", name)
    try:
        yield
    except EnnError as e:
        if own:  # the console says `HH:MM:SS ERROR: <the error's one line>`
            logging.getLogger("enn.flow").error("%s", " ".join(str(e).split()))
        raise


def _run_recorded(
    name: str,
    path: Path,
    cfg: RunConfig,
    stages: tuple[StageSpec, ...],
    recorded: Recorded,
    logger: logging.Logger,
) -> dict[str, StageResult] | State:
    root = project_root(path)
    # A worker-started flow run: tool settings before mlflow is imported (the CLI did it already)
    layout = contain(
        project_layout(root, cfg.runtime.work_dir), groups=(TOOLS,), tracking_uri=cfg.tracking.uri
    )
    if dvc_state.has_dvc(root) and not dvc_state.owns(root, path):
        logger.warning(
            "%s is not this pipeline's params.yaml (%s): DVC, whose dvc.yaml reads that "
            "file, neither skips nor records these stages; `dvc status` shows them changed "
            "until `dvc repro`",
            path,
            root / "params.yaml",
        )
    elif (
        cfg.tracking.enabled
        and not recorded.plan.one_off()  # DVC does not skip a one-off run's stages: they run
        and dvc_state.owns(root, path)
        and dvc_state.all_fresh(root, stages)
    ):
        # a scheduled run with nothing to do added a parent "training #N" carrying the last
        # results' metrics, which read like a training; the stages still show as skipped
        logger.info(
            "%s: every stage is up to date (dvc status clean): nothing to run, so no MLflow "
            "run is recorded for it (the runs that made these outputs are in MLflow)",
            name,
        )
        cfg = dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, enabled=False))
    tags = {"prefect.flow_run_id": str(flow_run.get_id() or ""), "prefect.flow_name": name}
    tags.update(mlflow_tags(recorded.plan))
    run_id = str(flow_run.get_id() or "") or None
    record = _RECORD.get() or FlowRecord()
    record.flow_run_id = run_id
    record.params = recorded.summary()
    results = record.results
    try:
        with (
            pipeline_session(
                cfg,
                path,
                layout,
                name,
                run_id=run_id,
                tags=tags,
                group=batch_group(),  # every `enn` of a batch job under one parent run
                specs=stages,
            ) as session,
            watch_cancellation(run_id) as cancel,
            cancel_scope(cancel),
        ):
            session.one_off = recorded.plan.one_off()  # DVC stays out of a one-off run
            if session.tracker is not None:
                record.mlflow_experiment_id = session.tracker.experiment_id
                record.mlflow_run_id = session.parent_id
            for spec in stages:
                if cancel.is_set():
                    raise FlowRunCancelled(
                        f"flow run cancelled before {spec.name}; no further stage ran"
                    )
                opts = stage_task(spec).with_options(timeout_seconds=cfg.runtime.task_timeout_s)
                record.running, record.running_since = spec.name, time.monotonic()
                try:
                    result = results[spec.name] = opts(session)
                except Exception as e:
                    if cancel.is_set():  # the stage failed because its workers were killed
                        raise FlowRunCancelled(
                            f"flow run cancelled during {spec.name}; its workers were stopped"
                        ) from e
                    raise
                record.running = None
                if result.status == "ran":
                    recorded.keep()  # outputs (and dvc.lock) were made with these values
                logger.info(
                    "%s: %s in %.1f s (%s)", spec.name, result.status, result.seconds, result.reason
                )
                if after_multinode(session, result, logger):
                    break
    except FlowRunCancelled as e:
        logger.warning("%s", e)
        return Cancelled(message=str(e))
    return results


def after_multinode(session: PipelineSession, result: StageResult, logger: logging.Logger) -> bool:
    """After a stage that ran across nodes (distributed-train, predict): True on a node
    without global rank 0 (it published nothing; the flow stops here), else the later stages
    run on this node alone (runtime.nnodes=1 for them: no other node joins them)."""
    summary = result.summary
    if summary is None or summary.nodes <= 1:
        return False
    if summary.node_only:
        logger.info(
            "%s: this node's share is done; the node of global rank 0 published the outputs "
            "and runs the later stages",
            result.stage,
        )
        return True
    rt = dataclasses.replace(session.cfg.runtime, nnodes=1, rdzv_endpoint="", rdzv_id="")
    session.cfg = dataclasses.replace(session.cfg, runtime=rt)
    logger.info("%s: the later stages run on this node only", result.stage)
    return False


def run_name() -> str:
    """A flow run's name in Prefect: what it does (`training params.yaml train.lr=0.02`),
    not a random pair of words; on a server several machines share, its host as well
    (`training @node1 params.yaml`)."""
    params = flow_run.parameters
    parts = [str(flow_run.flow_name), host_in_name(), Path(str(params.get("config") or "")).name]
    parts += [redact_override(str(o)) for o in params.get("overrides") or []]
    if params.get("model"):
        parts.append(f"model={params['model']}")
    if params.get("until"):
        parts.append(f"until {params['until']}")
    return " ".join(p for p in parts if p)[:150]


@flow(name="training", flow_run_name=run_name, persist_result=False, log_prints=True)
def training(
    config: str = "params.yaml", overrides: list[str] | None = None, until: str | None = None
) -> dict[str, StageResult] | State:
    """Run the seven training stages (or those up to `until`); returns each stage's status."""
    with flow_console(config, overrides, "training"):
        return run_stages("training", config, overrides, up_to("training", until))


if __name__ == "__main__":
    training()
