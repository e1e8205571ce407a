"""What a study shared by hosts needs on top of Optuna's storage: which trials a killed study
of this host left (`left_here`), a failed or stopped trial's point queued again (`retry`), the
RUNNING trials that never beat given one beat (`adopt_orphans`), a point popped twice run once
(`duplicate_of`), the count before a trial runs (docs/design.md, "A study across hosts")."""

from __future__ import annotations

import contextvars
import copy
import logging
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import RetryHeartbeatStaleTrialCallback as Retry
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState

from tasks.tuning.store import DUPLICATE_ATTR, NOT_RUN_ATTR, OWNER_ATTR, Storage, TrialOwner

log = logging.getLogger("enn.tune")
START_TOLERANCE_S = 0.01  # psutil's create_time of one process, read twice, agrees to this


def trial_command(job_file: Path) -> list[str]:
    """How the study starts the trial whose job file is `job_file`."""
    return [sys.executable, "-m", "tasks.tuning.trial", str(job_file)]


def left_here(owner: TrialOwner | None, job_file: Path) -> bool:
    """Whether `owner` is a trial of this host for this checkout's study (`job_file`: the
    trial's job file) whose `enn tune` is gone."""
    if owner is None or owner.host != socket.gethostname():
        return False
    if tuple(owner.cmdline[-3:]) != tuple(trial_command(job_file)[-3:]):
        return False
    if owner.study_pid <= 0:
        return True
    try:
        p = psutil.Process(owner.study_pid)
        same = abs(p.create_time() - owner.study_started) <= START_TOLERANCE_S
        return not (same and p.status() != psutil.STATUS_ZOMBIE)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return True


def fail(study: Study, number: int) -> bool:
    """Trial `number` told FAIL; False when it had ended already (another host did it)."""
    try:
        study.tell(number, state=TrialState.FAIL)
    except (ValueError, UpdateFinishedTrialError):  # "Cannot tell a FAIL trial"
        return False
    return True


def never_ran(trial: FrozenTrial) -> bool:
    """Asked while the study was full, or a duplicate: its point is queued or ran elsewhere."""
    return NOT_RUN_ATTR in trial.user_attrs or DUPLICATE_ATTR in trial.user_attrs


def retry_of(trial: FrozenTrial) -> int | None:
    """The trial `trial` runs again (the last of Optuna's retry history), unless it never ran."""
    history = [] if never_ran(trial) else Retry.retry_history(trial)
    return history[-1] if history else None


def retry(study: Study, number: int, stopped: bool = False) -> None:
    """Trial `number`'s point queued again by Optuna's RetryHeartbeatStaleTrialCallback: once
    when it failed (max_retry=1), each time the study stopped it; not when a retry of it
    exists, nor when it never ran. The point is checked when popped (objective.check_point)."""
    trials = study.get_trials(deepcopy=False)
    trial = next(t for t in trials if t.number == number)
    if never_ran(trial) or any(retry_of(t) == number for t in trials):
        return
    trial = copy.copy(trial)
    trial.user_attrs = {}  # its owner record and --set values are its own, not its retry's
    Retry(max_retry=None if stopped else 1)(study, trial)


class StaleTrials:
    """The storage's `heartbeat_stale_trial_callback`, on the one host that failed the trial:
    `retry`, then the listeners (the tracker), in the flow run's context (Optuna's threads
    lack it)."""

    def __init__(self) -> None:
        self.listeners: list[Callable[[int], None]] = []
        self.context = contextvars.copy_context()

    def __call__(self, study: Study, trial: FrozenTrial) -> None:
        self.context.copy().run(self.failed, study, trial)

    def failed(self, study: Study, trial: FrozenTrial) -> None:
        owner = TrialOwner.parse(trial.user_attrs.get(OWNER_ATTR))
        host = owner.host if owner else "an unknown host"
        log.warning("trial %d (on %s) missed its heartbeats: failed, run again", trial.number, host)
        retry(study, trial.number)
        for listener in self.listeners:
            listener(trial.number)


def adopt_orphans(study: Study) -> None:
    """store.Storage.adopt_orphans for the study's storage (Optuna's cache wraps it)."""
    storage = getattr(study._storage, "_backend", study._storage)
    if isinstance(storage, Storage):
        storage.adopt_orphans(study._study_id)


def duplicate_of(trials: Sequence[FrozenTrial], number: int) -> int | None:
    """The lower number of a trial that runs what trial `number` (just popped) runs, else None:
    a queued point queued twice (not FAIL), or a retry of one trial queued twice. Only queued
    points compare (a sampler may repeat one on purpose)."""
    mine = next(t for t in trials if t.number == number)
    point, retry = mine.system_attrs.get("fixed_params"), retry_of(mine)
    for t in trials:
        if t.number >= number:
            continue
        if retry is not None and retry_of(t) == retry:
            return int(t.number)
        queued = t.system_attrs.get("fixed_params", t.params)
        if retry is None and point is not None and t.state != TrialState.FAIL and queued == point:
            return int(t.number)
    return None


def counts(trials: Sequence[FrozenTrial], below: int | None = None) -> tuple[int, set[int]]:
    """Complete or pruned trials, and the running ones that run; with `below`, only those
    numbered below it (of two trials asked at once the lower runs)."""
    done = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    running = {
        t.number
        for t in trials
        if t.state == TrialState.RUNNING
        and NOT_RUN_ATTR not in t.user_attrs
        and (below is None or t.number < below)
    }
    return done, running
