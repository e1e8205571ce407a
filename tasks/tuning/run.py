"""Run a study end to end (what the tuning flow calls); read its best values.

    tune(cfg, config, overrides, layout) -> StudyResult
    best_values(cfg, config, overrides, layout) -> (values, objective, trial number)

One `enn tune` per study and checkout at a time (a lock on `work/tune/<study>.lock`); on a
shared storage (`tune.storage`), one per host joins the same study. Trials hold no lock and
the pipeline's lock is not taken: a study writes only under `work/tune/`, its storage and
MLflow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from enn_core.config import RunConfig
from enn_core.config.tune import dimensions, points
from enn_core.errors import ConfigError
from enn_core.paths import Layout
from tasks.lock import pipeline_lock
from tasks.tuning import store
from tasks.tuning import study as st
from tasks.tuning.shared import StaleTrials
from tasks.tuning.tracking import StudyTracker

log = logging.getLogger("enn.tune")


@dataclass(frozen=True)
class StudyResult:
    """What a study run gave: its table, best trial, where it lives."""

    name: str
    storage: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None
    best_value: float | None = None
    best_trial: int | None = None
    ended_stale: tuple[int, ...] = ()
    parallel: int = 1
    seconds: float = 0.0
    mlflow_run_id: str | None = None


def tune(
    cfg: RunConfig,
    config: Path,
    overrides: list[str],
    layout: Layout,
    should_stop: Callable[[], bool] = lambda: False,
) -> StudyResult:
    t0 = time.monotonic()
    plan = st.make_plan(cfg, config, overrides, layout)
    with pipeline_lock(plan.folder.with_suffix(".lock"), f"enn tune ({plan.name})"):
        on_stale = StaleTrials(dimensions(cfg.tune), plan.shown)
        study = st.open_study(cfg, plan, on_stale)  # first: a host on other data stops here
        st.stage_study_data(plan, cfg, study)
        with store.reading(plan.storage):
            stale = st.end_stale_trials(study, plan, dimensions(cfg.tune))
        if stale:
            log.info("study %s: trials %s were interrupted; ran again", plan.name, stale)
        done = st.finished(study)
        log.info(
            "study %s: %d of %d trials done; %d side by side (%s); storage %s",
            plan.name,
            done,
            cfg.tune.n_trials,
            plan.parallel,
            ", ".join(plan.runtime[:1]),
            plan.shown,
        )
        tracker = StudyTracker(cfg, layout, plan.name)
        parent = tracker.start({"enn.config": str(config)})
        on_stale.listeners.append(tracker.stale)
        error: BaseException | None = None
        try:
            with store.reading(plan.storage, records=False):
                st.run_study(study, cfg, plan, tracker, should_stop)
        except BaseException as e:
            error = e
            raise
        finally:
            rows = st.table(study)
            tracker.finish(study, rows, error)
    top = st.best(study)
    return StudyResult(
        name=plan.name,
        storage=plan.shown,
        rows=rows,
        best=points(top[0], dimensions(cfg.tune)) if top else None,  # as its trial ran them
        best_value=top[1] if top else None,
        best_trial=top[2] if top else None,
        ended_stale=tuple(stale),
        parallel=plan.parallel,
        seconds=time.monotonic() - t0,
        mlflow_run_id=parent,
    )


def best_values(
    cfg: RunConfig, config: Path, overrides: list[str], layout: Layout
) -> tuple[dict[str, Any], float, int]:
    """The study's best complete trial: its values (only keys of the config's `tune.space`,
    each a point of it: the database is data), objective and number."""
    plan = st.make_plan(cfg, config, overrides, layout)
    study = store.load_study(plan.name, plan.storage)
    with store.reading(plan.storage):
        top = st.best(study)
    if top is None:
        raise ConfigError(
            f"{plan.shown}: study {plan.name!r} has no complete trial yet; run `enn tune` to "
            "finish one"
        )
    values, objective, number = top
    where = f"{plan.shown}: best trial {number}"
    then = "--apply writes only those: nothing written"
    dims = dimensions(cfg.tune)
    return points(store.space_values(values, dims, where, then), dims), objective, number
