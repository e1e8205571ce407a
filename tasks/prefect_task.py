"""The Prefect side of a stage: a task that asks DVC whether the stage is stale, runs it
through the shared runner when it is, records it in dvc.lock, and publishes an artifact.

Retries: only `TransientError` (worker launch, I/O) is retried, with back-off; bad input and
config errors fail at once (`only_transient`).
"""

from __future__ import annotations

import json

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from enn_core.config import load_config
from enn_core.errors import TransientError
from tasks import dvc_state
from tasks.runner import PipelineSession, StageResult, execute_stage


def only_transient(task_, task_run, state) -> bool:
    """Prefect retry condition: retry transient errors only."""
    try:
        state.result(raise_on_failure=True)
    except TransientError:
        return True
    except BaseException:  # noqa: BLE001 - any other failure is final by design
        return False
    return False


def publish(stage: str, result: StageResult) -> None:
    """A markdown summary and a table of headline numbers, per stage."""
    key = f"{stage}-summary"
    lines = [
        f"# {stage}",
        "",
        f"**{result.status}** ({result.reason}) in {result.seconds:.1f} s",
        "",
    ]
    rows = []
    for k, v in sorted(result.summary.items()):
        if isinstance(v, (int, float, str, bool)) or v is None:
            rows.append({"name": k, "value": v})
        else:
            lines.append(f"- `{k}`: `{json.dumps(v, default=str)[:300]}`")
    if result.mlflow_run_id:
        lines.append(f"\nMLflow run: `{result.mlflow_run_id}`")
    create_markdown_artifact(key=key, markdown="\n".join(lines), description=f"{stage} summary")
    if rows:
        create_table_artifact(key=f"{stage}-table", table=rows, description=f"{stage} figures")
    for name, table in (result.summary.get("tables") or {}).items():
        create_table_artifact(
            key=f"{stage}-{name}".replace("_", "-").lower(),
            table=table,
            description=f"{stage}: {name}",
        )


def publish_diagnostics(stage: str, session: PipelineSession) -> None:
    """The stage's diagnostics record (written by the runner, also on failure) as an artifact."""
    run_dir = session.layout.run_dir(session.run_id, stage)
    md = run_dir / "diagnostics.md"
    if md.exists():
        create_markdown_artifact(
            key=f"{stage}-diagnostics",
            markdown=md.read_text(),
            description=f"{stage}: where a problem is (diagnostics record)",
        )
    diag = run_dir / "diagnostics.json"
    rows = json.loads(diag.read_text()).get("candidates") if diag.exists() else None
    # collapse-check: every candidate, how far it is from passing and why (also when all collapsed)
    if rows:
        create_table_artifact(
            key=f"{stage}-candidates", table=rows, description=f"{stage}: candidates"
        )


def run_stage(stage: str, config_path: str, session: PipelineSession) -> dict:
    cfg = load_config(config_path)
    root = session.layout.root
    use_dvc = dvc_state.owns(root, config_path)
    if use_dvc:
        fresh, why = dvc_state.stage_status(root, stage)
        if fresh:
            result = StageResult(stage, "skipped", why, {}, "", None, 0.0, 0.0)
            publish(stage, result)
            return result.to_dict()
    try:
        result = execute_stage(stage, cfg, session)
    finally:
        publish_diagnostics(stage, session)
    if use_dvc:
        dvc_state.commit(root, stage)
    publish(stage, result)
    return result.to_dict()


def stage_task(stage: str):
    """The Prefect task for `stage` (named by the stage: one name everywhere)."""

    @task(
        name=stage,
        retries=2,
        retry_delay_seconds=[1, 5],
        retry_condition_fn=only_transient,
        persist_result=False,
    )
    def _task(config_path: str, session: PipelineSession) -> dict:
        """Run the stage unless DVC says it is up to date (pipeline: session.pipeline)."""
        return run_stage(stage, config_path, session)

    return _task
