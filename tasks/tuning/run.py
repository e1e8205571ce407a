"""Run a study end to end (the tuning flow calls `tune`) under one lock per study and checkout;
read its best values (`--apply`) (docs/design.md, "Tuning")."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import optuna
from optuna.study import MaxTrialsCallback, Study
from optuna.trial import TrialState

from enn_core.config import RunConfig
from enn_core.config.tune import dimensions, points, space_values
from enn_core.errors import ConfigError
from enn_core.paths import Layout
from tasks.lock import pipeline_lock
from tasks.tracking.study import StudyTracker
from tasks.tuning import shared, store
from tasks.tuning import study as st
from tasks.tuning.objective import Ended, Objective

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
    dims = dimensions(cfg.tune)
    optuna_logs_as_enn_does()
    with pipeline_lock(plan.folder.with_suffix(".lock"), f"enn tune ({plan.name})"):
        tracker = StudyTracker(cfg, layout, plan.name)  # first: a deleted experiment is one line
        on_stale = shared.StaleTrials()
        study = st.open_study(cfg, plan, on_stale)  # first: a host on other data stops here
        st.stage_study_data(plan, cfg)
        with store.reading(plan.storage):
            stale = st.end_stale_trials(study, plan)
            done, _ = shared.counts(study.get_trials(deepcopy=False))
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
            if done < cfg.tune.n_trials or plan.shared:  # a finished local study asks none
                with stop_on_signals(objective.stop):
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
    return StudyResult(
        name=plan.name,
        storage=plan.shown,
        rows=rows,
        best=points(top[0], dims) if top else None,  # as its trial ran them
        best_value=top[1] if top else None,
        best_trial=top[2] if top else None,
        ended_stale=tuple(stale),
        parallel=plan.parallel,
        seconds=time.monotonic() - t0,
        mlflow_run_id=parent,
    )


def optimize(study: Study, objective: Objective, n_trials: int, plan: st.StudyPlan) -> None:
    """`study.optimize` until the study is done or stopped; again when a trial of this host
    was failed elsewhere (Optuna's tell of it raises)."""
    done = MaxTrialsCallback(n_trials, states=(TrialState.COMPLETE, TrialState.PRUNED))
    if isinstance(study, store.TuneStudy):
        study.gate = objective.room  # a full study is waited on by reading it
    while True:
        objective.lost = False
        try:
            study.optimize(objective, n_jobs=plan.parallel, catch=(Ended,), callbacks=[done])
        except store.StudyEnds:  # done or stopped, asked for no trial
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


def optuna_logs_as_enn_does() -> None:
    """Optuna's lines without its own stderr handler: to `enn`'s log file (flows/console.py)
    where `enn` set up its logging, else to the root logger."""
    optuna.logging.disable_default_handler()
    if not logging.getLogger("optuna").handlers:
        optuna.logging.enable_propagation()


def best_values(
    cfg: RunConfig, config: Path, overrides: list[str], layout: Layout
) -> tuple[dict[str, Any], float, int, list[str]]:
    """The study's best complete trial: its values (points of the config's `tune.space`: the
    database is data), objective, number and the --set values it trained under."""
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
