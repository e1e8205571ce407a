"""The tuning flow: an Optuna study over prepare-checkpoint and distributed-train
(`tasks/tuning/`), its trials as a Prefect table artifact.

Run: `enn tune` (or deployed: `enn deploy` serves it on demand). `enn tune --apply` writes the
best values into the config file the study ran with (`apply_best`). Cancelling the flow run
(UI, `prefect flow-run cancel`) stops the running trials; the study resumes at the next run.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run

from enn_core.config import RunConfig, redact_override
from enn_core.errors import ConfigError, DataError
from enn_core.paths import Layout, project_root
from flows.params_file import apply_overrides
from flows.prefect_api import host_in_name
from flows.training import load_once, watch_cancellation
from tasks.env import TOOLS, contain, project_layout
from tasks.tuning.objective import StudyResult, best_values, tune
from tasks.tuning.study import override

log = logging.getLogger("enn.flow")


def tuning_run_name() -> str:
    params = flow_run.parameters
    parts = ["tuning", host_in_name(), Path(str(params.get("config") or "")).name]
    parts += [redact_override(str(o)) for o in params.get("overrides") or []]
    return " ".join(p for p in parts if p)[:150]


def publish(result: StudyResult) -> None:
    """The study's table (trials, values, objective, state) as a Prefect table artifact."""
    rows = [{k: ("" if v is None else v) for k, v in row.items()} for row in result.rows]
    if rows:
        create_table_artifact(
            key=f"tune-{result.name}".replace("_", "-").lower(),
            table=rows,
            description=f"study {result.name}: trials, values, objective ({result.storage})",
        )


@flow(name="tuning", flow_run_name=tuning_run_name, persist_result=False, log_prints=True)
def tuning(config: str = "params.yaml", overrides: list[str] | None = None) -> dict:
    """Run (or resume) the study `tune:` declares in `config`; returns its best trial."""
    path = Path(config).resolve()
    cfg = load_once(path, list(overrides or []))
    layout = contain(
        project_layout(project_root(path), cfg.runtime.work_dir),
        groups=(TOOLS,),
        tracking_uri=cfg.tracking.uri,
    )
    run_id = str(flow_run.get_id() or "") or None
    with watch_cancellation(run_id) as cancel:
        result = tune(cfg, path, list(overrides or []), layout, should_stop=cancel.is_set)
    publish(result)
    return {
        "study": result.name,
        "best": result.best,
        "best_value": result.best_value,
        "best_trial": result.best_trial,
        "trials": len(result.rows),
        "mlflow_run_id": result.mlflow_run_id,
    }


def apply_best(cfg: RunConfig, config: Path, overrides: list[str], layout: Layout) -> list[str]:
    """Write the study's best values into `config` (comments kept), so `dvc repro` trains the
    winner and DVC versions it. Returns 'key: old -> new' lines."""
    values, objective, number, ran_with = best_values(cfg, config, overrides, layout)
    sets = [override(k, v) for k, v in sorted(values.items())]
    try:  # validated as `--set` would be: the database is data
        lines = apply_overrides(config, sets)
    except ConfigError as e:
        raise DataError(
            f"study {cfg.tune.study or config.stem}: best trial {number}'s values are refused "
            f"by the config ({e}); nothing written"
        ) from e
    head = f"trial {number} ({cfg.tune.metric} {objective:.4g})"
    note = sets_note(config, pipeline_sets(ran_with))
    if not lines:
        return [f"{config.name} already holds {head}'s values", *note]
    return [f"{config.name}: {line} ({head})" for line in lines] + note


# at most this many of a trial's recorded --set values are read (the database is data)
MAX_SETS = 64


def pipeline_sets(sets: list[str]) -> list[str]:
    """Of the --set values a trial trained under (recorded in the study), those of the
    pipeline's sections: the ones params.yaml holds and `dvc repro` trains with. The study is
    data another host may have written: only a printable `key=value` of a real config key
    counts (no terminal control sequence reaches the console), and at most MAX_SETS of them."""
    from enn_core.config import all_config_keys
    from enn_core.config.loader import parse_override
    from flows.params_file import tracked_sections

    keys, out = all_config_keys(), []
    for text in sets[:MAX_SETS]:
        if len(text) > 1000 or not text.isprintable():
            continue
        try:
            key = parse_override(text)[0]
        except ConfigError:  # a value that is no --set is not one
            continue
        if key in keys and key.split(".")[0] in tracked_sections():
            out.append(text)
    return out


def sets_note(config: Path, sets: list[str]) -> list[str]:
    """`study ran with --set train.epochs=2; params.yaml has train.epochs 3: ...`: the study's
    --set values the config file does not hold (the winner was found under them), or []."""
    from enn_core.config import load_config, to_plain
    from enn_core.config.loader import parse_override

    if not sets:
        return []
    try:
        file = to_plain(load_config(config))
    except ConfigError:
        return []
    differ = []
    for text in sets:
        key, value = parse_override(text)
        held: object = file
        for part in key.split("."):
            held = held.get(part) if isinstance(held, dict) else None
        if held != value and not (
            isinstance(held, (int, float)) and isinstance(value, (int, float)) and held == value
        ):
            differ.append((redact_override(text), f"{key} {held}"))
    if not differ:
        return []
    ran = " ".join(f"--set {t}" for t, _ in differ)
    has = ", ".join(h for _, h in differ)
    return [
        f"note: the study ran with {ran}; {config.name} has {has}: `dvc repro` trains the best "
        f"values with the file's; add {ran} to `enn run` to train as the trials did"
    ]


if __name__ == "__main__":
    tuning()
