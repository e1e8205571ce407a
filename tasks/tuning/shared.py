"""What a study shared by several hosts needs on top of Optuna's storage.

Optuna already numbers trials (one sequence per study in the storage), hands each waiting
trial to one caller (`ask` pops it atomically), and fails trials whose heartbeat stopped
(`optuna.storages.fail_stale_trials`, RDBStorage's heartbeat, the database's clock). Its
heartbeat only drives itself inside `study.optimize`; under ask/tell the study loop does it:

- `Heartbeat.tick` records a beat for each trial process this host runs and still sees
  alive, then calls `fail_stale_trials`, every `tune.heartbeat_s`;
- `StaleTrials` is the callback Optuna calls for a trial it failed as stale: its values
  queued again (when they are points of the space: the storage is data) and the tracker told;
- `fail` ends a trial as FAIL unless another host ended it first (then it does nothing);
- `duplicate_of`: two hosts that start at once may both queue `tune.enqueue`'s points (Optuna's
  `skip_if_exists` reads, then writes); of two queued trials of one point only the lower
  number runs.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from enn_core.config.tune import Dimension
from enn_core.errors import DataError
from tasks.tuning import store

log = logging.getLogger("enn.tune")
RETRY_ATTR = "enn.retry_of"  # a queued trial's user attribute: the interrupted trial it reruns
DUPLICATE_ATTR = "enn.duplicate_of"


def fail(study: Any, number: int) -> bool:
    """Trial `number` told FAIL; False when it had ended already (another host did it)."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    try:
        study.tell(number, state=TrialState.FAIL)
    except (ValueError, UpdateFinishedTrialError):  # "Cannot tell a FAIL trial": ended already
        return False
    return True


def requeue(study: Any, trial: Any, dims: Sequence[Dimension], where: str) -> None:
    """Trial `trial`'s values queued again (the same point, as if never interrupted), when
    they are points of the space."""
    try:
        where = f"{where}: trial {trial.number}"
        values = store.space_values(trial.params, dims, where, "not run again")
    except DataError as e:
        log.warning("%s", e)
        return
    study.enqueue_trial(values, user_attrs={RETRY_ATTR: trial.number})


class StaleTrials:
    """Optuna's `heartbeat_stale_trial_callback`: runs on the one host whose
    `fail_stale_trials` failed the trial."""

    def __init__(self, dims: Sequence[Dimension], where: str) -> None:
        self.dims, self.where = dims, where
        self.listeners: list[Callable[[int], None]] = []

    def __call__(self, study: Any, trial: Any) -> None:
        host = owner_host(trial)
        log.warning(
            "trial %d (on %s) missed its heartbeats: failed, its values queued again",
            trial.number,
            host,
        )
        requeue(study, trial, self.dims, self.where)
        for listener in self.listeners:
            listener(trial.number)


def owner_host(trial: Any) -> str:
    from tasks.tuning.owner import OWNER_ATTR, TrialOwner

    owner = TrialOwner.parse(trial.user_attrs.get(OWNER_ATTR))
    return owner.host if owner else "an unknown host"


class Heartbeat:
    """Beats for this host's running trials and the stale-trial sweep, every `interval_s`."""

    def __init__(self, study: Any, interval_s: float) -> None:
        self.study, self.interval_s = study, interval_s
        self.last = 0.0

    def beat(self, trial: Any) -> None:
        """One beat for `trial` (an optuna.Trial this host runs). Optuna has no public call for
        it under ask/tell: its storage's `record_heartbeat` takes the trial's id."""
        self.study._storage.record_heartbeat(trial._trial_id)

    def tick(self, alive: Sequence[Any], force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.interval_s:
            return
        self.last = now
        for trial in alive:
            self.beat(trial)
        from optuna.exceptions import ExperimentalWarning
        from optuna.storages import fail_stale_trials

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            fail_stale_trials(self.study)


def duplicate_of(study: Any, trial: Any) -> int | None:
    """The lower number of a queued trial of the same point as `trial` (just popped by `ask`)
    that is not FAIL, else None. Only queued trials are compared (a sampler may repeat a point
    of a small grid on purpose), and a rerun of an interrupted trial is not a duplicate."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    mine = next(t for t in trials if t.number == trial.number)
    point = mine.system_attrs.get("fixed_params")
    if point is None or RETRY_ATTR in mine.user_attrs:
        return None
    for other in trials:
        if other.number >= trial.number or other.state == TrialState.FAIL:
            continue
        if other.system_attrs.get("fixed_params", other.params) == point:
            return int(other.number)
    return None


def ask(study: Any, space: dict[str, Any]) -> Any:
    """`study.ask(space)`, without Optuna's warning that its heartbeat is meant for
    `study.optimize` (`Heartbeat` drives it here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        return study.ask(space)


def counts(study: Any) -> tuple[int, set[int]]:
    """The study's complete or pruned trials (every host's), and the numbers of its running
    ones."""
    from optuna.trial import TrialState

    trials = study.get_trials(
        deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    )
    running = {int(t.number) for t in trials if t.state == TrialState.RUNNING}
    return len(trials) - len(running), running
