"""What a shared study (`tune.storage`) holds after hosts wait on it and retry its trials,
without training (issue 52): a host asking a full or finished study adds no row; a trial
cancelled on one host and then swept as stale on another has its point queued once, and a
second retry of it that was queued anyway (two hosts at the same moment) is not run."""

from __future__ import annotations

import threading
import time

import pytest
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import TrialState

from enn_core.config import load_config
from enn_core.config.tune import dimensions
from tasks.tuning import study as st
from tasks.tuning.objective import Ended, optimize
from tests.fixtures.study import objective
from tests.unit.tasks.test_shared_study import LR, shared_plan

POINT = {"train.lr": 0.02}


def _study(tmp_path, *sets: str):
    cfg = load_config(None, [LR, *sets])
    plan = shared_plan(tmp_path)
    return cfg, plan, st.open_study(cfg, plan, st.StaleTrials())  # as `enn tune` opens it


def _rows(study) -> list[tuple[int, str]]:
    return [(t.number, t.state.name) for t in study.get_trials()]


@pytest.mark.timeout(60)
def test_a_host_asking_a_full_study_waits_by_reading_it_and_adds_no_row(tmp_path):
    """Another host's trial fills the study (tune.n_trials=1): this host's `enn tune` waits,
    and the study gains no row (it gained a FAIL row, owned by pid 0, per host that asked);
    when that trial completes, this host ends, the study still one row."""
    cfg, plan, study = _study(tmp_path, "tune.n_trials=1")
    space = {d.key: d.distribution() for d in dimensions(cfg.tune)}
    with pytest.warns(UserWarning, match="Heartbeat of storage is supposed to be used"):
        theirs = study.ask(space)  # another host's trial, beating
    study._storage.record_heartbeat(theirs._trial_id)
    node1 = objective(study, cfg, plan)
    waiting = threading.Thread(target=optimize, args=(study, node1, cfg.tune.n_trials, plan))
    waiting.start()
    time.sleep(2.5)
    assert waiting.is_alive() and _rows(study) == [(0, "RUNNING")]
    study.tell(theirs, 0.5)  # their trial completes: the study is done
    waiting.join(10)
    assert not waiting.is_alive()
    assert _rows(study) == [(0, "COMPLETE")]
    optimize(study, objective(study, cfg, plan), cfg.tune.n_trials, plan)  # a host joins late
    assert _rows(study) == [(0, "COMPLETE")]
    assert not (tmp_path / "s").exists() or not list((tmp_path / "s").glob("trial-*"))


@pytest.mark.timeout(60)
def test_a_cancelled_trial_swept_as_stale_elsewhere_has_its_point_queued_once(tmp_path):
    """A job array's task is cancelled mid-trial: its `enn tune` queues the trial's point again
    and dies before telling the trial (RUNNING, its heartbeat stops); another host's sweep then
    fails it as stale. The point is queued once (it was queued twice, and both ran to
    completion: two of the study's counted trials were one point)."""
    cfg, plan, study = _study(tmp_path, "tune.heartbeat_s=1", "tune.stale_after_s=2")
    space = {d.key: d.distribution() for d in dimensions(cfg.tune)}
    study.enqueue_trial(POINT)
    with pytest.warns(UserWarning, match="Heartbeat of storage is supposed to be used"):
        cancelled = study.ask(space)
    study._storage.record_heartbeat(cancelled._trial_id)  # then its host died
    # what its stop did: the point queued again, as a retry of the cancelled trial
    st.retry(study, cancelled.number, stopped=True)
    node2 = objective(study, cfg, plan)
    t0 = time.monotonic()
    while study.get_trials()[cancelled.number].state.name == "RUNNING":
        assert time.monotonic() - t0 < 30, "the cancelled trial was never failed"
        node2.last_sweep = 0.0
        node2.sweep()
        time.sleep(0.2)
    queued = [t for t in study.get_trials() if t.state.name == "WAITING"]
    assert [t.system_attrs["fixed_params"] for t in queued] == [POINT]


def test_a_second_retry_of_one_point_queued_at_the_same_moment_is_not_run(tmp_path):
    """Two hosts queued a failed trial's point again at the same moment (each read before
    the other wrote): the first retry runs (here: completes), the second is not run."""
    cfg, plan, study = _study(tmp_path)
    space = {d.key: d.distribution() for d in dimensions(cfg.tune)}
    study.enqueue_trial(POINT)
    first = study.ask(space)
    study.tell(first, state=TrialState.FAIL)
    for _ in range(2):  # each host's Optuna callback, before it saw the other's retry
        RetryHeartbeatStaleTrialCallback(max_retry=1)(study, study.get_trials()[first.number])
    retry = study.ask(space)
    study.tell(retry, 0.5)
    study.optimize(objective(study, cfg, plan), n_trials=1, catch=(Ended,))
    complete = [t.params for t in study.get_trials() if t.state.name == "COMPLETE"]
    assert complete == [POINT] and _rows(study)[-1] == (2, "FAIL")
    assert not list((tmp_path / "s").glob("trial-*"))


def test_a_retry_the_study_stopped_runs_again_and_a_failure_then_is_not_retried(tmp_path):
    """A retry cut short by the study's stop (Ctrl-C) is queued again and runs: it is not a
    second retry of the first trial's point. Failed after that, the point is not retried: a
    point is run again once after a failure (Optuna's retry history, max_retry=1)."""
    cfg, plan, study = _study(tmp_path)
    space = {d.key: d.distribution() for d in dimensions(cfg.tune)}
    study.enqueue_trial(POINT)
    first = study.ask(space)
    study.tell(first, state=TrialState.FAIL)
    st.retry(study, first.number)  # failed: its point queued again
    retry = study.ask(space)
    st.retry(study, retry.number, stopped=True)  # what the stop does, then Optuna's tell
    study.tell(retry, state=TrialState.FAIL)
    again = study.ask(space)
    assert again.params == POINT and st.duplicate_of(study.get_trials(), again.number) is None
    study.tell(again, state=TrialState.FAIL)
    st.retry(study, again.number)
    assert [t.state.name for t in study.get_trials()] == ["FAIL"] * 3
