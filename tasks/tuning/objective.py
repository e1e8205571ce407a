"""A study run end to end (`tune`), each trial one process group (`Objective`); its best values
(`--apply`). docs/design.md, "Tuning" and "A study across hosts"."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import logging
import os
import queue
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, TypeVar

import optuna
from optuna.exceptions import TrialPruned, UpdateFinishedTrialError
from optuna.storages import fail_stale_trials
from optuna.study import MaxTrialsCallback, Study
from optuna.trial import FrozenTrial, Trial, TrialState

from enn_core.atomic import write_json
from enn_core.config import RunConfig, load_config
from enn_core.config.tune import dimensions, points, space_values
from enn_core.errors import ConfigError, DataError, TrainingError
from enn_core.events import EventTail
from enn_core.paths import Layout
from enn_core.runtime import children
from tasks.lock import pipeline_lock
from tasks.tracking.study import StudyTracker
from tasks.tuning import store
from tasks.tuning import study as st
from tasks.tuning.store import TuneStudy
from tasks.tuning.trial import TrialJob, events_file

log = logging.getLogger("enn.tune")
MAX_FAILED_IN_A_ROW = 3
POLL_S = 0.2
T = TypeVar("T")


class Ended(Exception):
    """The trial ended without a value (Optuna marks it FAIL)."""


@dataclass
class RunningTrial:
    number: int
    params: dict[str, Any]
    folder: Path
    started: float
    values: list[tuple[int, float]] = field(default_factory=list)
    events: EventTail = field(init=False)

    def __post_init__(self) -> None:
        self.events = EventTail(events_file(self.folder))

    def new_values(self, metric: str) -> list[tuple[int, float]]:
        """The `epoch/<metric>` values appended to the trial's events since the last call."""
        out = [
            (int(rec["step"]), float(rec["value"]))
            for rec in self.events.new()
            if rec.get("type") == "metric" and rec.get("name") == f"epoch/{metric}"
        ]
        self.values += out
        return out


@dataclass(frozen=True)
class TrialEnd:
    """How a trial ended (its end.json)."""

    number: int
    state: str  # complete | pruned | failed | interrupted
    value: float | None
    params: dict[str, Any]
    epochs: int
    seconds: float
    pids: Sequence[int] = ()
    gone_s: float | None = None

    def __str__(self) -> str:
        value = f"objective {self.value:.4g}" if self.value is not None else "no value"
        gone = f"; its {len(self.pids)} processes gone in {self.gone_s:.1f} s" if self.pids else ""
        return f"{self.state} after {self.epochs} epoch(s), {value}, {self.seconds:.0f} s{gone}"


class Hooks(Protocol):
    """What the study tells its tracker (tasks/tracking/study.py)."""

    def started(self, trial: RunningTrial) -> None: ...
    def reported(self, trial: RunningTrial, epoch: int, value: float) -> None: ...
    def ended(self, trial: RunningTrial, end: TrialEnd) -> None: ...


class Objective:
    """`study.optimize`'s objective for the plan's study."""

    def __init__(
        self,
        study: Study,
        cfg: RunConfig,
        plan: st.StudyPlan,
        hooks: Hooks,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        self.study, self.cfg, self.plan, self.hooks = study, cfg, plan, hooks
        self.dims, self.tune, self.should_stop = dimensions(cfg.tune), cfg.tune, should_stop
        self.stop, self.lock = threading.Event(), threading.Lock()
        self.error: BaseException | None = None  # what stopped the study, raised after optimize
        self.lost = False  # a trial of this host was failed elsewhere (its tell will fail)
        self.failed_in_a_row, self.last_sweep = 0, 0.0
        self.context = contextvars.copy_context()  # Prefect's flow run, for the trial threads
        self.slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(plan.parallel):
            self.slots.put(slot)

    def halt(self, error: BaseException | None = None) -> None:
        """Stop the study (`study.stop` needs Optuna's loop: in an objective's thread)."""
        with self.lock:
            self.error = self.error or error
        self.stop.set()
        self.study.stop()

    def stopping(self) -> bool:
        if self.should_stop() and not self.stop.is_set():
            log.warning("study %s stopped: its running trials are killed", self.plan.name)
            self.stop.set()
        return self.stop.is_set()

    def storage(self, call: Callable[[], T]) -> T:
        """`call`, retried while the storage does not answer, up to `tune.stale_after_s`."""
        first = time.monotonic()
        while True:
            try:
                return call()
            except Exception as e:
                if store.lost(e) is None:
                    raise
                if time.monotonic() - first > self.tune.stale_after_s or self.stop.is_set():
                    self.halt(store.failure(self.plan.storage, e, records=False))
                    raise Ended(str(e)) from e
                time.sleep(1.0)

    def sweep(self) -> None:
        """Stale trials failed (Optuna's sweep; orphans adopted first), once per heartbeat_s."""
        with self.lock:
            if time.monotonic() - self.last_sweep < self.tune.heartbeat_s:
                return
            self.last_sweep = time.monotonic()
        storage = getattr(self.study._storage, "_backend", self.study._storage)
        if isinstance(storage, store.Storage):
            self.storage(functools.partial(storage.adopt_orphans, self.study._study_id))
        self.storage(lambda: fail_stale_trials(self.study))

    def __call__(self, trial: Trial) -> float:
        return self.context.copy().run(self.objective, trial)

    def objective(self, trial: Trial) -> float:
        if self.stopping():
            self.halt()
            raise Ended("the study stops")
        folder = st.trial_folder(self.plan, trial.number)
        # its owner from its first moment: a restarted study of this host finds what it left
        owner = store.TrialOwner.of(st.trial_command(folder / "trial.json"))
        self.storage(lambda: trial.set_user_attr(store.OWNER_ATTR, owner.to_json()))
        trials = self.storage(lambda: self.study.get_trials(deepcopy=False))
        mine = next(t for t in trials if t.number == trial.number)
        self.check_point(trial, trials, mine)
        done, running = st.counts(trials, below=trial.number)
        if done + len(running) >= self.tune.n_trials:
            self.storage(lambda: trial.set_user_attr(store.NOT_RUN_ATTR, True))
            self.not_run(mine)
        for dim in self.dims:
            if dim.key not in trial.params:  # a retry has its values (as they were checked)
                dim.suggest(trial)
        slot = self.slots.get()
        try:
            return self.run(trial, folder, slot)
        finally:
            self.slots.put(slot)

    def check_point(self, trial: Trial, trials: list[FrozenTrial], mine: FrozenTrial) -> None:
        """A popped point runs once, and only as a point of `tune.space`."""
        twin = st.duplicate_of(trials, trial.number)
        if twin is not None:
            trial.set_user_attr(store.DUPLICATE_ATTR, twin)
            log.info("trial %d: the point of trial %d (queued twice); not run", trial.number, twin)
            raise Ended(f"the point of trial {twin}")
        fixed = {**mine.params, **(mine.system_attrs.get("fixed_params") or {})}
        where = f"{self.plan.shown}: trial {trial.number}"
        try:
            space_values(fixed, self.dims, where, "not run; the study goes on")
        except DataError as e:
            trial.set_user_attr(store.NOT_RUN_ATTR, True)
            log.warning("%s", e)
            raise Ended(str(e)) from e

    def room(self) -> None:
        """Before each ask (TuneStudy's gate): wait while the study is full; Ended once it is done
        or stops (docs/design.md, "The count is at the top of the objective")."""
        said = False
        while not self.stopping():
            done, running = st.counts(self.storage(lambda: self.study.get_trials(deepcopy=False)))
            if done >= self.tune.n_trials:
                break
            if done + len(running) < self.tune.n_trials:
                return
            if not said:
                log.info(
                    "study %s: full while trials %s run; waiting", self.plan.name, sorted(running)
                )
                said = True
            self.sweep()
            time.sleep(1.0)
        raise Ended("done" if not self.stop.is_set() else "stopped")

    def not_run(self, mine: FrozenTrial) -> None:
        """Asked while the study was full: not run, a queued point or retry put back as it was."""
        if {"fixed_params", "failed_trial"} & set(mine.system_attrs):  # queued, or a retry
            back = copy.copy(mine)  # as it was: its point, its retry record; not its attributes
            back.state, back.datetime_start, back.user_attrs = TrialState.WAITING, None, {}
            self.storage(lambda: self.study.add_trial(back))
        raise Ended("the study was full")

    def run(self, trial: Trial, folder: Path, slot: int) -> float:
        """The trial as a process group, followed to its end."""
        values = [st.override(k, v) for k, v in points(trial.params, self.dims).items()]
        sets = [o for o in self.plan.overrides if not o.startswith("tune.storage=")]
        overrides = (*sets, *values, *self.plan.runtime, "tracking.enabled=false")
        try:  # a value the config refuses is the study's error (its space), not a trial's
            load_config(self.plan.config, list(overrides))
        except ConfigError as e:
            self.halt(e)
            raise
        if folder.is_symlink() or folder.is_file():
            folder.unlink()
        elif folder.exists():  # a number is never reused in one study: another study's leftover
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        plan = self.plan
        job = TrialJob(
            trial.number, str(plan.config), overrides, str(plan.root), str(plan.staged), str(folder)
        )
        env = {**os.environ, "OMP_NUM_THREADS": plan.runtime[0].split("=")[1]}
        if plan.gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(slot % plan.gpus)
        # what it trains under besides its point, in the study: `--apply` on any host reads it
        self.storage(lambda: trial.set_user_attr(store.SETS_ATTR, list(sets)))
        command = st.trial_command(job.write())
        child = children.start(  # its own group: pruning kills the group
            "trial", command, env=env, log=folder / "trial.log", session=True, cwd=plan.root
        )
        running = RunningTrial(trial.number, trial.params, folder, time.monotonic())
        try:
            log.info("trial %d: %s", trial.number, st.shown(trial.params))
            self.hooks.started(running)
            return self.follow(running, trial, child)
        except BaseException as e:  # stopped: Ctrl-C, SIGTERM, the stop event, the storage gone
            if not (folder / "end.json").exists():
                self.end(running, "interrupted", None, *kill_trial(child))
                if not self.lost:
                    if not isinstance(e, (Exception, KeyboardInterrupt)):  # design.md, Tuning
                        self.quietly(lambda: self.study.tell(trial.number, state=TrialState.FAIL))
                    self.quietly(lambda: st.retry(self.study, trial.number, stopped=True))
            raise

    def follow(self, running: RunningTrial, trial: Trial, child: children.Child) -> float:
        metric = self.tune.metric
        while not self.stopping():
            for epoch, value in running.new_values(metric):
                try:
                    self.storage(functools.partial(trial.report, value, epoch))
                except UpdateFinishedTrialError as e:  # another host failed it as stale
                    self.lost = True
                    log.warning(
                        "trial %d was failed as stale by another host: stopped here", trial.number
                    )
                    raise Ended(str(e)) from e
                self.hooks.reported(running, epoch, value)
                if self.storage(trial.should_prune):
                    self.end(running, "pruned", value, *kill_trial(child))
                    raise TrialPruned(f"epoch {epoch}: {metric} {value:.4g}")
            rc = child.proc.poll()
            if rc is not None:
                running.new_values(metric)  # what it wrote before it exited
                return self.ended(running, rc)
            self.sweep()
            time.sleep(POLL_S)
        self.halt()
        raise Ended("the study stops")

    def ended(self, running: RunningTrial, rc: int) -> float:
        best = min((v for _, v in running.values), default=None)
        if rc == 0 and best is not None:
            self.end(running, "complete", best)
            return best
        log_file = running.folder / "trial.log"
        tail = log_file.read_text(errors="replace").strip().splitlines()[-1:]
        log.warning("trial %d failed (exit %d): %s", running.number, rc, " ".join(tail))
        self.end(running, "failed", best)
        with self.lock:
            self.failed_in_a_row += 1
            many = self.failed_in_a_row >= MAX_FAILED_IN_A_ROW
        if many:
            why = f"{MAX_FAILED_IN_A_ROW} trials failed in a row; the last one's log: {log_file}"
            self.halt(TrainingError(why))
        raise Ended(f"exit {rc}")

    def end(
        self,
        running: RunningTrial,
        state: str,
        value: float | None,
        pids: list[int] | None = None,
        gone: float | None = None,
    ) -> None:
        st.remove_checkpoints(running.folder)
        took, epochs = time.monotonic() - running.started, len(running.values)
        end = TrialEnd(running.number, state, value, running.params, epochs, took, pids or [], gone)
        write_json(running.folder / "end.json", end.__dict__)
        if state in ("complete", "pruned"):
            with self.lock:
                self.failed_in_a_row = 0
        level = logging.DEBUG if state == "interrupted" else logging.INFO  # the stop says it
        log.log(level, "trial %d: %s", end.number, str(end).replace("objective", self.tune.metric))
        self.quietly(lambda: self.hooks.ended(running, end))

    def quietly(self, call: Callable[[], object]) -> None:
        """`call` while the study stops (a storage that is gone was said once)."""
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the study's own error is what is reported
            log.debug("while stopping: %s", e)


def kill_trial(child: children.Child) -> tuple[list[int], float]:
    """The trial's group killed (children.stop: docs/design.md); its pids, the seconds they took."""
    t0 = time.monotonic()
    pids = children.stop(child)
    return pids, time.monotonic() - t0


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
