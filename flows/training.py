"""The training flow: the seven stages in order, each a Prefect task over one enn_core
function. DVC decides which stages are stale; stages that are up to date are skipped.

Run: `enn run` (or `python -m flows.training`). Parameters are typed: the config path and
`--set` overrides (written into the config file first, as `dvc exp run -S` does).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from enn_core.config import load_config
from enn_core.paths import STAGES
from flows.params_file import apply_overrides
from tasks.collapse_check import collapse_check
from tasks.distributed_train import distributed_train
from tasks.export import export
from tasks.predict import predict
from tasks.prepare_checkpoint import prepare_checkpoint
from tasks.session import pipeline_session
from tasks.stage_data import stage_data
from tasks.validate import validate

TRAINING_TASKS = {
    "stage-data": stage_data,
    "prepare-checkpoint": prepare_checkpoint,
    "distributed-train": distributed_train,
    "validate": validate,
    "predict": predict,
    "collapse-check": collapse_check,
    "export": export,
}
assert tuple(TRAINING_TASKS) == STAGES


def select(stages: dict, until: str | None) -> dict:
    """The stages up to and including `until` (all when None)."""
    if until is None:
        return stages
    if until not in stages:
        from enn_core.errors import ConfigError

        raise ConfigError(f"--until {until!r} is not a stage of this flow; pick one of {list(stages)}")
    names = list(stages)
    return {k: stages[k] for k in names[: names.index(until) + 1]}


def run_stages(name: str, config: str, overrides: list[str] | None, stages: dict,
               pipeline: str = "training") -> dict:
    logger = get_run_logger()
    path = Path(config).resolve()
    for change in apply_overrides(path, list(overrides or [])):
        logger.info("params: %s", change)
    cfg = load_config(path)
    tags = {"prefect.flow_run_id": str(flow_run.get_id() or ""), "prefect.flow_name": name}
    results: dict[str, dict] = {}
    run_id = str(flow_run.get_id() or "") or None
    with pipeline_session(cfg, path.parent, name, run_id=run_id, tags=tags, pipeline=pipeline) as session:
        for stage, task_ in stages.items():
            opts = task_.with_options(timeout_seconds=cfg.runtime.task_timeout_s)
            results[stage] = opts(str(path), session)
            logger.info("%s: %s (%s)", stage, results[stage]["status"], results[stage]["reason"])
    return results


@flow(name="training", persist_result=False, log_prints=True)
def training(config: str = "params.yaml", overrides: list[str] | None = None, until: str | None = None) -> dict:
    """Run the seven training stages (or those up to `until`); returns each stage's status."""
    return run_stages("training", config, overrides, select(TRAINING_TASKS, until))


if __name__ == "__main__":
    training()
