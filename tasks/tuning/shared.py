"""What a study shared by several hosts needs on top of Optuna's storage.

Optuna numbers trials, pops each queued one to one caller, beats for each running trial
inside `study.optimize` (the storage's `heartbeat_interval`) and fails a trial silent for its
`grace_period` (`fail_stale_trials`, the database's clock). On top of that:

- `StaleTrials`, the `heartbeat_stale_trial_callback`: the failed trial's point queued again
  once (only a point of `tune.space`: the storage is data), the tracker told;
- `fail_orphans`: Optuna's sweep skips a RUNNING trial that never had a heartbeat (a client
  asked for it and died): one with no owner record is failed once it is older than the stale
  bound plus `CLOCK_SKEW_S` by its start time, or than the stale bound since this host first
  saw it;
- `duplicate_of`: of two queued trials of one point (two hosts enqueueing at once), only the
  lower number runs;
- `counts`: complete or pruned trials, and the running ones a trial counts before it runs.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Sequence

from optuna.exceptions import UpdateFinishedTrialError
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState

from enn_core.config.tune import Dimension, space_values
from enn_core.errors import DataError
from tasks.tuning.owner import OWNER_ATTR, TrialOwner

log = logging.getLogger("enn.tune")
RETRY_ATTR = "enn.retry_of"  # a queued trial's user attribute: the trial it runs again
DUPLICATE_ATTR = "enn.duplicate_of"
NOT_RUN_ATTR = "enn.not_run"  # asked when the study was full: never ran, left out of tables
CLOCK_SKEW_S = 60


def fail(study: Study, number: int) -> bool:
    """Trial `number` told FAIL; False when it had ended already (another host did it)."""
    try:
        study.tell(number, state=TrialState.FAIL)
    except (ValueError, UpdateFinishedTrialError):  # "Cannot tell a FAIL trial"
        return False
    return True


def requeue(study: Study, trial: FrozenTrial, dims: Sequence[Dimension], where: str) -> None:
    """`trial`'s point queued again, when it is a point of the space."""
    try:
        values = space_values(trial.params, dims, f"{where}: trial {trial.number}", "not run again")
    except DataError as e:
        log.warning("%s", e)
        return
    study.enqueue_trial(values, user_attrs={RETRY_ATTR: trial.number})


class StaleTrials:
    """Optuna's `heartbeat_stale_trial_callback`: runs on the one host that failed the trial."""

    def __init__(self, dims: Sequence[Dimension], where: str) -> None:
        self.dims, self.where = dims, where
        self.listeners: list[Callable[[int], None]] = []

    def __call__(self, study: Study, trial: FrozenTrial) -> None:
        owner = TrialOwner.parse(trial.user_attrs.get(OWNER_ATTR))
        host = owner.host if owner else "an unknown host"
        log.warning(
            "trial %d (on %s) missed its heartbeats: failed, its values queued again",
            trial.number,
            host,
        )
        requeue(study, trial, self.dims, self.where)
        for listener in self.listeners:
            listener(trial.number)


class Orphans:
    """RUNNING trials with no owner record, failed once older than the stale bound."""

    def __init__(self, stale_after_s: float, on_stale: StaleTrials) -> None:
        self.stale_after_s, self.on_stale = stale_after_s, on_stale
        self.seen: dict[int, float] = {}  # number -> when this host first saw it

    def fail(self, study: Study, running: Sequence[FrozenTrial]) -> list[int]:
        now, failed = time.monotonic(), []
        wall = datetime.datetime.now()
        for t in running:
            if OWNER_ATTR in t.user_attrs:
                continue
            first = self.seen.setdefault(t.number, now)
            age = (wall - t.datetime_start).total_seconds() if t.datetime_start else 0.0
            if now - first < self.stale_after_s and age < self.stale_after_s + CLOCK_SKEW_S:
                continue
            if fail(study, t.number):  # its point queued again, as a stale trial's
                self.on_stale(study, t)
                failed.append(t.number)
        return failed


def duplicate_of(trials: Sequence[FrozenTrial], number: int) -> int | None:
    """The lower number of a queued trial of the same point as trial `number` (just popped)
    that is not FAIL, else None. Only queued points compare (a sampler may repeat a point on
    purpose), and a rerun of an interrupted trial is not a duplicate."""
    mine = next(t for t in trials if t.number == number)
    point = mine.system_attrs.get("fixed_params")
    if point is None or RETRY_ATTR in mine.user_attrs:
        return None
    for other in trials:
        if other.number >= number or other.state == TrialState.FAIL:
            continue
        if other.system_attrs.get("fixed_params", other.params) == point:
            return int(other.number)
    return None


def counts(trials: Sequence[FrozenTrial], below: int | None = None) -> tuple[int, set[int]]:
    """Complete or pruned trials, and the numbers of the running ones that run (not those
    asked while the study was full); with `below`, only running trials numbered below it (of
    two trials asked at once, the lower runs first: the count never waits on itself)."""
    done = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    running = {
        t.number
        for t in trials
        if t.state == TrialState.RUNNING
        and NOT_RUN_ATTR not in t.user_attrs
        and (below is None or t.number < below)
    }
    return done, running
