"""One trial as one launch: the objective `study.optimize` calls, in one of its threads.

It counts the study first (complete + pruned + the running trials numbered below its own, every
host's): a full study ends the trial asked as not run (`enn.not_run`, left out of tables) and
waits until another host's trial ends or the study is done; a queued point outside
`tune.space` (the storage is data) or queued twice ends the same way, and the host goes on.
Else it starts `tasks.tuning.trial` as its own process group, follows its `epoch/<metric>`
events, reports them and prunes (SIGKILL to the group, then `TrialPruned`); every
`tune.heartbeat_s` it sweeps stale trials (`fail_stale_trials`) and orphans
(`shared.Orphans`). Optuna's heartbeat thread beats for the trial meanwhile. The stop event
(Ctrl-C, SIGTERM, a cancelled flow run, a fatal error) ends each running trial within a
second: its group killed, its point queued again. A storage that stops answering is retried
for `tune.stale_after_s` (another host fails the trial then anyway), then the study stops
with one StoreError.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil
from optuna.exceptions import TrialPruned, UpdateFinishedTrialError
from optuna.storages import fail_stale_trials
from optuna.study import Study
from optuna.trial import FrozenTrial, Trial, TrialState

from enn_core.atomic import write_json
from enn_core.config import RunConfig, load_config
from enn_core.config.tune import Dimension, dimensions, points
from enn_core.errors import ConfigError, DataError, TrainingError
from enn_core.events import EventTail
from tasks.tuning import shared, store
from tasks.tuning import study as st
from tasks.tuning.owner import OWNER_ATTR, TrialOwner, trial_command
from tasks.tuning.trial import TrialJob, events_file

log = logging.getLogger("enn.tune")
MAX_FAILED_IN_A_ROW = 3
POLL_S = 0.2
T = TypeVar("T")


class NotRun(Exception):
    """The trial asked never ran (the study was full; its point refused or queued twice)."""


class Stopped(Exception):
    """The study stops (the stop event): the trial's group was killed, its point queued again."""


class TrialFailed(Exception):
    """The trial's process failed (its log names why)."""


@dataclass
class RunningTrial:
    """A trial process the objective follows."""

    trial: Trial | None
    folder: Path
    proc: subprocess.Popen[bytes] | None
    started: float
    values: list[tuple[int, float]] = field(default_factory=list)
    events: EventTail = field(init=False)

    def __post_init__(self) -> None:
        self.events = EventTail(events_file(self.folder))

    @property
    def number(self) -> int:
        return self.trial.number if self.trial is not None else -1

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
    pids: tuple[int, ...] = ()
    gone_s: float | None = None


class Hooks:
    """What the study tells its tracker (MLflow) as trials start, report and end."""

    def started(self, trial: RunningTrial) -> None: ...

    def reported(self, trial: RunningTrial, epoch: int, value: float) -> None: ...

    def ended(self, trial: RunningTrial, end: TrialEnd) -> None: ...


def describe(end: TrialEnd, metric: str) -> str:
    value = f"{metric} {end.value:.4g}" if end.value is not None else "no value"
    gone = f"; its {len(end.pids)} processes gone in {end.gone_s:.1f} s" if end.pids else ""
    return f"{end.state} after {end.epochs} epoch(s), {value}, {end.seconds:.0f} s{gone}"


class Objective:
    """`study.optimize`'s objective for the plan's study; `stop` ends it everywhere."""

    def __init__(
        self,
        study: Study,
        cfg: RunConfig,
        plan: st.StudyPlan,
        hooks: Hooks,
        on_stale: shared.StaleTrials,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        self.study, self.cfg, self.plan, self.hooks = study, cfg, plan, hooks
        self.dims: tuple[Dimension, ...] = dimensions(cfg.tune)
        self.should_stop = should_stop
        self.stop = threading.Event()
        self.error: BaseException | None = None  # what stopped the study, raised after optimize
        self.lost = False  # a trial of this host was failed elsewhere (its tell will fail)
        self.lock = threading.Lock()
        self.failed_in_a_row = 0
        self.last_sweep = 0.0
        self.orphans = shared.Orphans(cfg.tune.stale_after_s, on_stale)
        self.slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(plan.parallel):
            self.slots.put(slot)

    def halt(self, error: BaseException | None = None) -> None:
        """Stop the study (from the objective's thread: `study.stop` needs Optuna's loop)."""
        with self.lock:
            if error is not None and self.error is None:
                self.error = error
        self.stop.set()
        self.study.stop()

    def stopping(self) -> bool:
        if self.should_stop() and not self.stop.is_set():
            log.warning("study %s stopped: its running trials are killed", self.plan.name)
            self.stop.set()
        return self.stop.is_set()

    def storage(self, call: Callable[[], T]) -> T:
        """`call` on the storage, retried while it does not answer, for up to
        `tune.stale_after_s`; then the study stops with one StoreError naming the storage."""
        from sqlalchemy.exc import OperationalError

        first = time.monotonic()
        while True:
            try:
                return call()
            except OperationalError as e:
                if time.monotonic() - first > self.cfg.tune.stale_after_s or self.stop.is_set():
                    self.halt(store.unreachable(self.plan.storage, e))
                    raise Stopped(str(e)) from e
                time.sleep(1.0)

    def sweep(self) -> None:
        """Stale trials (Optuna's sweep) and orphans failed, once per `tune.heartbeat_s`."""
        with self.lock:
            if time.monotonic() - self.last_sweep < self.cfg.tune.heartbeat_s:
                return
            self.last_sweep = time.monotonic()
        self.storage(lambda: fail_stale_trials(self.study))
        running = self.storage(
            lambda: self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        )
        self.storage(lambda: self.orphans.fail(self.study, running))

    def __call__(self, trial: Trial) -> float:
        if self.stopping():
            self.halt()
            raise NotRun("the study stops")
        folder = st.trial_folder(self.plan, trial.number)
        owner = TrialOwner.of(0, trial_command(folder / "trial.json"))
        self.storage(lambda: trial.set_user_attr(OWNER_ATTR, owner.to_json()))
        trials = self.storage(lambda: self.study.get_trials(deepcopy=False))
        mine = next(t for t in trials if t.number == trial.number)
        self.check_point(trial, trials, mine)
        done, running = shared.counts(trials, below=trial.number)
        if done + len(running) >= self.cfg.tune.n_trials:
            self.storage(lambda: trial.set_user_attr(shared.NOT_RUN_ATTR, True))
            self.wait_full(trial, mine, done)
        for dim in self.dims:
            suggest(trial, dim)
        slot = self.slots.get()
        try:
            return self.run(trial, folder, slot)
        finally:
            self.slots.put(slot)

    def check_point(self, trial: Trial, trials: list[FrozenTrial], mine: FrozenTrial) -> None:
        """A queued point runs once, and only as a point of `tune.space`."""
        twin = shared.duplicate_of(trials, trial.number)
        if twin is not None:
            trial.set_user_attr(shared.DUPLICATE_ATTR, twin)
            log.info("trial %d: the point of trial %d (queued twice); not run", trial.number, twin)
            raise NotRun(f"the point of trial {twin}")
        fixed = {**mine.params, **(mine.system_attrs.get("fixed_params") or {})}
        try:
            store.space_values(
                fixed, self.dims, f"{self.plan.shown}: trial {trial.number}", "not run"
            )
        except DataError as e:
            trial.set_user_attr(shared.NOT_RUN_ATTR, True)
            log.warning("%s", e)
            raise NotRun(str(e)) from e

    def wait_full(self, trial: Trial, mine: FrozenTrial, done: int) -> None:
        """The study is full: done (stop), or wait until another trial ends; then not run (its
        queued point, if it popped one, queued again)."""
        seen = None
        while done < self.cfg.tune.n_trials and not self.stopping():
            self.sweep()
            trials = self.storage(lambda: self.study.get_trials(deepcopy=False))
            done, running = shared.counts(trials)
            if seen is None:
                seen = running
                log.info(
                    "study %s: waiting for other hosts' trials %s", self.plan.name, sorted(running)
                )
            elif running != seen:
                break
            time.sleep(1.0)
        if done >= self.cfg.tune.n_trials or self.stop.is_set():
            self.halt()
        fixed = mine.system_attrs.get("fixed_params")
        if fixed and done < self.cfg.tune.n_trials:
            retry = (
                {shared.RETRY_ATTR: mine.user_attrs[shared.RETRY_ATTR]}
                if shared.RETRY_ATTR in mine.user_attrs
                else None
            )
            self.storage(lambda: self.study.enqueue_trial(fixed, user_attrs=retry))
        raise NotRun("the study was full")

    def run(self, trial: Trial, folder: Path, slot: int) -> float:
        """The trial as a process group, followed to its end."""
        point = points(trial.params, self.dims)  # 0.002358, not 17 digits
        sets = tuple(o for o in self.plan.overrides if not o.startswith("tune.storage="))
        overrides = (*sets, *(st.override(k, v) for k, v in point.items()), *self.plan.runtime)
        overrides = (*overrides, "tracking.enabled=false")
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
        job = TrialJob(
            trial.number,
            str(self.plan.config),
            overrides,
            str(self.plan.root),
            str(self.plan.staged),
            str(folder),
        )
        env = {**os.environ, "OMP_NUM_THREADS": self.plan.runtime[0].split("=")[1]}
        if self.plan.gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(slot % self.plan.gpus)
        command = trial_command(job.write())
        with open(folder / "trial.log", "wb") as out:
            proc = subprocess.Popen(
                command,
                cwd=self.plan.root,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: pruning and stopping kill the group
            )
        running = RunningTrial(trial, folder, proc, time.monotonic())
        try:
            trial.set_user_attr(OWNER_ATTR, TrialOwner.of(proc.pid, command).to_json())
            log.info("trial %d: %s", trial.number, st.shown(trial.params))
            self.hooks.started(running)
            return self.follow(running)
        except BaseException as e:  # Ctrl-C in the main thread, a storage gone, a bug
            if proc.poll() is None or not (folder / "end.json").exists():
                pids, gone = self.kill(proc)
                self.end(running, "interrupted", None, pids, gone)
                if not isinstance(e, (TrialPruned, TrialFailed, NotRun)) and not self.lost:
                    fixed = {k: v for k, v in trial.params.items()}
                    retry = {shared.RETRY_ATTR: trial.number}
                    self.quietly(lambda: self.study.enqueue_trial(fixed, user_attrs=retry))
            raise

    def follow(self, running: RunningTrial) -> float:
        trial, proc = running.trial, running.proc
        assert trial is not None and proc is not None
        metric = self.cfg.tune.metric
        while True:
            if self.stopping():
                self.halt()
                raise Stopped("the study stops")
            for epoch, value in running.new_values(metric):
                try:
                    self.storage(functools.partial(trial.report, value, epoch))
                except UpdateFinishedTrialError as e:  # another host failed it as stale
                    self.lost = True
                    log.warning(
                        "trial %d was failed as stale by another host (no heartbeat for %d s): "
                        "stopped here",
                        trial.number,
                        self.cfg.tune.stale_after_s,
                    )
                    raise Stopped(str(e)) from e
                self.hooks.reported(running, epoch, value)
                if self.storage(trial.should_prune):
                    pids, gone = self.kill(proc)
                    self.end(running, "pruned", value, pids, gone)
                    raise TrialPruned(f"epoch {epoch}: {metric} {value:.4g}")
            rc = proc.poll()
            if rc is not None:
                running.new_values(metric)  # what it wrote before it exited
                return self.ended(running, rc)
            self.sweep()
            time.sleep(POLL_S)

    def ended(self, running: RunningTrial, rc: int) -> float:
        best = min((v for _, v in running.values), default=None)
        if rc == 0 and best is not None:
            self.end(running, "complete", best)
            return best
        tail = (running.folder / "trial.log").read_text(errors="replace").strip().splitlines()[-1:]
        log.warning("trial %d failed (exit %d): %s", running.number, rc, " ".join(tail))
        self.end(running, "failed", best)
        with self.lock:
            self.failed_in_a_row += 1
            many = self.failed_in_a_row >= MAX_FAILED_IN_A_ROW
        if many:
            last = running.folder / "trial.log"
            self.halt(
                TrainingError(
                    f"{MAX_FAILED_IN_A_ROW} trials failed in a row; the last one's log: {last}"
                )
            )
        raise TrialFailed(f"exit {rc}")

    def kill(self, proc: subprocess.Popen[bytes]) -> tuple[list[int], float]:
        pids: list[int] = []
        gone = 0.0
        if proc.poll() is None:  # reaped already: its pid may be another process's now
            try:
                pids, gone = st.kill_tree(psutil.Process(proc.pid))
            except psutil.NoSuchProcess:
                pass
        proc.wait()
        return pids, gone

    def end(
        self,
        running: RunningTrial,
        state: str,
        value: float | None,
        pids: list[int] | None = None,
        gone: float | None = None,
    ) -> None:
        st.remove_checkpoints(running.folder)
        end = TrialEnd(
            running.number,
            state,
            value,
            running.trial.params if running.trial else {},
            len(running.values),
            time.monotonic() - running.started,
            tuple(pids or ()),
            gone,
        )
        write_json(running.folder / "end.json", end.__dict__)
        if state in ("complete", "pruned"):
            with self.lock:
                self.failed_in_a_row = 0
        log.info("trial %d: %s", end.number, describe(end, self.cfg.tune.metric))
        self.quietly(lambda: self.hooks.ended(running, end))

    def quietly(self, call: Callable[[], object]) -> None:
        """`call`, when the study stops anyway: a storage that is gone was said once."""
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the study's own error is what is reported
            log.debug("while stopping: %s", e)


def suggest(trial: Trial, dim: Dimension) -> Any:
    """The trial's value of `dim` (a queued point's own value, else the sampler's)."""
    if dim.kind == "choice":
        return trial.suggest_categorical(dim.key, list(dim.choices))
    if dim.kind == "int":
        step = int(dim.step) if dim.step is not None else 1
        return trial.suggest_int(dim.key, int(dim.low), int(dim.high), step=step, log=dim.log)
    return trial.suggest_float(dim.key, dim.low, dim.high, step=dim.step, log=dim.log)
