"""The Prefect side of a stage: a task that asks DVC whether the stage is stale, runs it
through the shared runner when it is, records it in dvc.lock, and publishes an artifact.

Retries: only `TransientError` (worker launch, I/O) is retried, with back-off; bad input and
config errors fail at once (`only_transient`).
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

from prefect import Task, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.schemas.objects import State, TaskRun

from enn_core.errors import TransientError
from enn_core.stages import StageSpec
from tasks import dvc_state
from tasks.runner import PipelineSession, StageResult, execute_stage
from tasks.ui import mlflow_run_url, mlflow_ui


def only_transient(task_: Task[..., Any], task_run: TaskRun, state: State) -> bool:
    """Prefect retry condition: retry transient errors only (and say so on the console:
    Prefect's own retry line is INFO of a third-party logger, kept in the log file)."""
    try:
        state.result(raise_on_failure=True)
    except TransientError as e:
        attempt = int(getattr(task_run, "run_count", 1) or 1)
        if attempt <= task_.retries:
            logging.getLogger("enn.flow").warning(
                "%s: transient error (%s): retry %d/%d", task_.name, e, attempt, task_.retries
            )
        return True
    except BaseException:  # noqa: BLE001 - any other failure is final by design
        return False
    return False


def publish(result: StageResult, session: PipelineSession) -> None:
    """A markdown summary and a table of headline numbers, per stage."""
    stage = result.stage
    lines = [
        f"# {stage}",
        "",
        f"**{result.status}** ({result.reason}) in {result.seconds:.1f} s",
        "",
    ]
    rows = []
    fields = result.summary.as_dict() if result.summary is not None else {}
    if result.registry:
        fields["registry"] = result.registry.as_dict()
    for k, v in sorted(fields.items()):
        if isinstance(v, (int, float, str, bool)) or v is None:
            rows.append({"name": k, "value": v})
        else:
            lines.append(f"- `{k}`: `{json.dumps(v, default=str)[:300]}`")
    if result.mlflow_run_id:
        lines.append(f"\nMLflow run: {run_link(session, result.mlflow_run_id)} (the UI: `enn ui`)")
    create_markdown_artifact(
        key=f"{stage}-summary", markdown="\n".join(lines), description=f"{stage} summary"
    )
    if rows:
        create_table_artifact(key=f"{stage}-table", table=rows, description=f"{stage} figures")


def run_link(session: PipelineSession, run_id: str) -> str:
    """`[<run id>](<its page in the MLflow UI>)`: the tracking server's, the one `enn ui`
    serves, or where `enn ui` serves it by default (deploy.host, deploy.mlflow_port)."""
    cfg = session.cfg
    base = mlflow_ui(cfg, session.layout.work)
    base = base or f"http://{cfg.deploy.host}:{cfg.deploy.mlflow_port}"
    exp = session.tracker.experiment_id if session.tracker else "0"
    return f"[{run_id}]({mlflow_run_url(base, exp, run_id)})"


def publish_diagnostics(spec: StageSpec, session: PipelineSession) -> None:
    """The stage's diagnostics record (written by the runner, also on failure) as an artifact,
    and each table the stage recorded (collapse-check: every candidate and why)."""
    run_dir = session.layout.run_dir(session.run_id, spec.name)
    md = run_dir / "diagnostics.md"
    if md.exists():
        create_markdown_artifact(
            key=f"{spec.name}-diagnostics",
            markdown=md.read_text(),
            description=f"{spec.name}: where a problem is (diagnostics record)",
        )
    diag = run_dir / "diagnostics.json"
    tables = json.loads(diag.read_text()).get("tables") or {} if diag.exists() else {}
    for name, rows in tables.items():
        if rows:
            create_table_artifact(
                key=f"{spec.name}-{name}".replace("_", "-").lower(),
                table=rows,
                description=f"{spec.name}: {name}",
            )


def run_stage(spec: StageSpec, session: PipelineSession) -> StageResult:
    root = session.layout.root
    use_dvc = dvc_state.owns(root, session.config) and not session.one_off
    if use_dvc:
        fresh, why = dvc_state.stage_status(root, spec)
        if fresh:
            result = StageResult(spec.name, "skipped", why, None, "", None, 0.0, 0.0)
            session.done.append(spec.name)  # its outputs are this run's too
            publish(result, session)
            return result
    try:
        result = execute_stage(spec, session)
    finally:
        publish_diagnostics(spec, session)
    # a node without global rank 0 published nothing: there is nothing for DVC to record
    if use_dvc and not (result.summary is not None and result.summary.node_only):
        dvc_state.commit(root, spec)
    publish(result, session)
    return result


@functools.cache
def stage_task(spec: StageSpec) -> Task[[PipelineSession], StageResult]:
    """The Prefect task of `spec`, named by the stage (one name everywhere)."""

    @task(
        name=spec.name,
        retries=2,
        retry_delay_seconds=[1, 5],
        retry_condition_fn=only_transient,
        persist_result=False,
    )
    def _task(session: PipelineSession) -> StageResult:
        """Run the stage unless DVC says it is up to date."""
        return run_stage(spec, session)

    return _task
