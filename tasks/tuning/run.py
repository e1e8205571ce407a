"""Run a study end to end (the tuning flow calls `tune`) under one lock per study and checkout;
read its best values (`--apply`) (docs/design.md, "Tuning")."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import optuna
from optuna.study import MaxTrialsCallback
from optuna.trial import TrialState

from enn_core.config import RunConfig
from enn_core.config.tune import dimensions, points, space_values
from enn_core.errors import ConfigError
from enn_core.paths import Layout
from tasks.lock import pipeline_lock
from tasks.tracking.study import StudyTracker
from tasks.tuning import store
from tasks.tuning import study as st
from tasks.tuning.objective import Ended, Objective
from tasks.tuning.store import TuneStudy

log = logging.getLogger("enn.tune")


@dataclass(frozen=True)
class StudyResult:
    """A study run's table and best trial."""

    name: str
    storage: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None
    best_value: float | None = None
    best_trial: int | None = None
    mlflow_run_id: str | None = None


def tune(
    cfg: RunConfig,
    config: Path,
    overrides: list[str],
    layout: Layout,
    should_stop: Callable[[], bool] = lambda: False,
) -> StudyResult:
    plan = st.make_plan(cfg, config, overrides, layout)
    optuna.logging.disable_default_handler()  # its lines to enn's log file (flows/console.py)
    if not logging.getLogger("optuna").handlers:  # or, where enn set up no logging, the root's
        optuna.logging.enable_propagation()
    with pipeline_lock(plan.folder.with_suffix(".lock"), f"enn tune ({plan.name})"):
        tracker = StudyTracker(cfg, layout, plan.name)  # first: a deleted experiment is one line
        on_stale = st.StaleTrials()
        study = st.open_study(cfg, plan, on_stale)  # first: a host on other data stops here
        st.stage_study_data(plan, cfg)
        with store.reading(plan.storage):
            stale = st.end_stale_trials(study, plan)
            done, _ = st.counts(study.get_trials(deepcopy=False))
        if stale:
            log.info("study %s: trials %s were interrupted; ran again", plan.name, stale)
        said = (plan.name, done, cfg.tune.n_trials, plan.parallel, plan.runtime[0], plan.shown)
        log.info("study %s: %d of %d trials done; %d side by side (%s); storage %s", *said)
        parent = tracker.start({"enn.config": str(config)})
        on_stale.listeners.append(tracker.stale)
        objective = Objective(study, cfg, plan, tracker, should_stop)
        error: BaseException | None = None
        rows: list[dict[str, Any]] = []
        try:
            with stop_on_signals(objective.stop):  # a finished study: the gate asks none
                optimize(study, objective, cfg.tune.n_trials, plan)
            with store.reading(plan.storage):
                rows, top = st.table(study), st.best(study)
        except BaseException as e:
            error = objective.error or e
            with contextlib.suppress(Exception):  # the storage may be what stopped the study
                rows = st.table(study)
            if objective.error is None:
                raise
            raise objective.error from None
        finally:
            tracker.finish(study, rows, error)
    values, value, number = top if top else ({}, None, None)
    ran = points(values, dimensions(cfg.tune)) if top else None  # as its trial ran them
    return StudyResult(plan.name, plan.shown, rows, ran, value, number, parent)


def optimize(study: TuneStudy, objective: Objective, n_trials: int, plan: st.StudyPlan) -> None:
    """`study.optimize`, again when a trial of this host was failed elsewhere."""
    done = MaxTrialsCallback(n_trials, states=(TrialState.COMPLETE, TrialState.PRUNED))
    study.gate = objective.room  # a full study is waited on by reading it
    while True:
        objective.lost = False
        try:
            study.optimize(objective, n_jobs=plan.parallel, catch=(Ended,), callbacks=[done])
        except Ended:  # the gate: done or stopped, asked for no trial
            pass
        except ValueError:  # "Cannot tell a FAIL trial": one of ours, failed elsewhere
            if objective.stop.is_set():  # Ctrl-C or SIGTERM came while Optuna told a trial
                raise KeyboardInterrupt from None  # that ended with it: the stop stands
            if not objective.lost:
                raise
            continue
        except Exception as e:  # Optuna's own call (ask, tell) when the storage went
            error = objective.error or store.failure(plan.storage, e, records=False)
            if error is None:
                raise
            raise error from e
        if objective.error is not None:
            raise objective.error
        return


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set `stop` (the running trials end), then do what they did."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {int(s): signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()
        previous = before[signum]
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    for s in before:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, previous in before.items():
            signal.signal(s, previous)


def best_values(
    cfg: RunConfig, config: Path, overrides: list[str], layout: Layout
) -> tuple[dict[str, Any], float, int, list[str]]:
    """The best complete trial's values (points of `tune.space`), objective, number, --set."""
    plan = st.make_plan(cfg, config, overrides, layout)
    study = store.load_study(plan.name, plan.storage)
    with store.reading(plan.storage):
        top = st.best(study)
        sets = store.sets_of(study, top[2]) if top is not None else []
    if top is None:
        raise ConfigError(
            f"{plan.shown}: study {plan.name!r} has no complete trial yet; run `enn tune` to "
            "finish one"
        )
    values, objective, number = top
    where, then = f"{plan.shown}: best trial {number}", "--apply writes only those: nothing written"
    dims = dimensions(cfg.tune)
    return points(space_values(values, dims, where, then), dims), objective, number, sets
