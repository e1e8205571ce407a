"""A study on a configured storage (`tune.storage`), without training: what a host does with
the trials other hosts run, and the URL's user and password kept out of what is shown.

- a storage URL with a password is refused (one line, the password not in it); its user is
  `***` in a run's config.yaml, the MLflow params, the console and Prefect's run name;
- a database server that cannot be reached is one line at once (exit 10), with no user;
- on a shared storage a starting study leaves other hosts' running trials alone (their
  heartbeat decides), and ends those a killed study of this checkout left;
- a trial whose heartbeat stopped is failed and its point queued again, once, by the one host
  that failed it; the tracker hears of it;
- two hosts' samplers draw different points from the same study; a point queued twice (two
  hosts enqueueing at once) runs once;
- hosts that both create the study's MLflow parent end with one.
- a study whose MLflow experiment was deleted is one line saying what to do.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from enn_core.config import load_config
from enn_core.config.tune import dimensions
from enn_core.errors import ConfigError
from enn_core.paths import Layout
from tasks.tuning import store
from tasks.tuning import study as st
from tasks.tuning.store import OWNER_ATTR, TrialOwner
from tests.fixtures.cli import enn
from tests.fixtures.study import study_plan

SPACE = {"train.lr": {"low": 0.001, "high": 0.1, "log": True}}
LR = f"tune.space={yaml.safe_dump(SPACE, default_flow_style=True).strip()}"
SERVER = "postgresql://alice@node3:5432/studies"


def shared_plan(tmp_path: Path, folder: str = "s", identity: str = "node1") -> st.StudyPlan:
    """A study `s` on the SQLite file `tmp_path/shared.db`, configured as a shared storage."""
    return dataclasses.replace(
        study_plan(tmp_path),
        folder=tmp_path / folder,
        storage=f"sqlite:///{tmp_path / 'shared.db'}",
        shared=True,
        identity=identity,
    )


def test_a_password_in_the_url_is_refused_without_showing_it(tmp_path):
    (tmp_path / "params.yaml").write_text(f"tune:\n  space: {json.dumps(SPACE)}\n")
    for url in ("postgresql://alice:s3cret@node3/studies", f"{SERVER}?password=s3cret"):
        code, lines = enn(tmp_path, "tune", "--apply", "--set", f"tune.storage={url}")
        assert code == 2 and len(lines) == 1, lines
        assert "holds a password" in lines[0] and "(PGPASSWORD) or in ~/.pgpass" in lines[0]
        assert "s3cret" not in lines[0] and "alice" not in lines[0]
    with pytest.raises(ConfigError, match="expected an SQLAlchemy URL"):
        load_config(None, ["tune.storage=http://node3/studies"])


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory) -> str:
    """One MLflow store for the module's tests (its migrations take seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def test_the_user_is_redacted_wherever_the_config_is_shown(tmp_path, mlflow_uri):
    from mlflow.tracking import MlflowClient

    from flows.params_file import mlflow_tags, once_lines, record_overrides, summary_line
    from tasks.runner import write_resolved
    from tasks.tracking import Tracker

    (tmp_path / "params.yaml").write_text("{}\n")
    uri = mlflow_uri
    sets = [f"tune.storage={SERVER}", f"tracking.uri={uri}"]
    cfg = load_config(None, sets)
    assert cfg.tune.storage == SERVER  # the run itself uses the URL as written
    text = write_resolved(cfg, tmp_path).read_text()
    assert "alice" not in text and "postgresql://***@node3:5432/studies" in text
    tracker = Tracker(cfg, Layout.for_root(tmp_path))
    run_id = tracker.start_parent("training", {}, cfg=cfg)
    params = MlflowClient(uri).get_run(run_id).data.params
    assert params["tune.storage"] == "postgresql://***@node3:5432/studies"
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")  # params.yaml: the pipeline's own
    p, changes = record_overrides(tmp_path / "params.yaml", sets[:1])
    assert changes == [] and "tune" not in (tmp_path / "params.yaml").read_text()
    shown = "tune.storage=postgresql://***@node3:5432/studies"
    said = [*once_lines(p), summary_line(p, changes) or "", *mlflow_tags(p).values()]
    assert all("alice" not in line for line in said), said
    assert (
        said[0]
        == f"{shown} for this run only (not pipeline parameters: how to run, not what to compute)"
    )
    assert said[1] == f"params: params.yaml unchanged ({shown} for this run only)"


@pytest.mark.timeout(60)
def test_a_server_that_cannot_be_reached_is_one_line(tmp_path):
    from flows.servers import free_port

    (tmp_path / "params.yaml").write_text(f"tune:\n  space: {json.dumps(SPACE)}\n")
    url = f"postgresql://alice@127.0.0.1:{free_port()}/studies"  # nothing listens there
    code, lines = enn(tmp_path, "tune", "--apply", "--set", f"tune.storage={url}")
    assert code == 10 and len(lines) == 1, lines
    assert "the study storage cannot be reached" in lines[0] and "alice" not in lines[0]


def record(host: str, job: Path, study_pid: int) -> str:
    me = psutil.Process()
    cmd = st.trial_command(job)
    return json.dumps(
        {
            "host": host,
            "pid": 999999999,  # its process is gone
            "started": 0.0,
            "cmdline": cmd,
            "study_pid": study_pid,
            "study_started": me.create_time() if study_pid == me.pid else 0.0,
        }
    )


def test_a_starting_study_leaves_other_hosts_trials_to_their_heartbeat(tmp_path):
    cfg = load_config(None, [LR])
    plan = shared_plan(tmp_path)
    study = st.open_study(cfg, plan)
    space = {d.key: d.distribution() for d in dimensions(cfg.tune)}
    mine = plan.folder / "trial-{}" / "trial.json"
    here = socket.gethostname()
    owners = [
        record("node2", Path(str(mine).format(0)), 0),  # another host's
        record(here, Path(str(mine).format(1)), psutil.Process().pid),  # a live study's, here
        record(here, tmp_path / "other" / "trial-2" / "trial.json", 0),  # another checkout's
        record(here, Path(str(mine).format(3)), 0),  # this checkout's, its study gone
    ]
    for raw in owners:
        study.ask(space).set_user_attr(OWNER_ATTR, raw)
    assert st.end_stale_trials(study, plan) == [3]
    states = [t.state.name for t in study.get_trials()]
    assert states == ["RUNNING", "RUNNING", "RUNNING", "FAIL", "WAITING"]
    retry = study.get_trials()[4]
    assert st.retry_of(retry) == 3 and retry.params == study.get_trials()[3].params
    assert TrialOwner.parse(owners[3]).study_pid == 0  # an older record's form parses too


# another host's `enn tune`: a trial under Optuna's optimize, beating, until it is SIGKILLed
DYING = """
import sys, time, optuna
storage = optuna.storages.RDBStorage(sys.argv[1], heartbeat_interval=1, grace_period=2)
study = optuna.load_study(study_name="s", storage=storage)
def objective(trial):
    trial.suggest_float("train.lr", 0.001, 0.1, log=True)
    open(sys.argv[2], "w").close()
    time.sleep(600)
study.optimize(objective)
"""


def sweep_until(objective, study, number: int, timeout: float) -> float:
    """`objective`'s sweep, as a trial of this host runs it, until trial `number` is not
    RUNNING; the seconds it took."""
    t0 = time.monotonic()
    while study.get_trials()[number].state.name == "RUNNING":
        assert time.monotonic() - t0 < timeout, f"trial {number} still RUNNING"
        objective.last_sweep = 0.0  # each call sweeps (a trial's loop sweeps every heartbeat_s)
        objective.sweep()
        time.sleep(0.2)
    return time.monotonic() - t0


@pytest.mark.timeout(60)
def test_a_trial_whose_heartbeat_stopped_is_failed_and_queued_again_once(tmp_path):
    import subprocess
    import sys

    from tests.fixtures.study import objective

    cfg = load_config(None, [LR, "tune.heartbeat_s=1", "tune.stale_after_s=2"])
    plan = shared_plan(tmp_path, identity="node1")
    heard: list[int] = []
    on_stale = st.StaleTrials()
    on_stale.listeners.append(heard.append)
    study = st.open_study(cfg, plan, on_stale)
    marker = tmp_path / "running"
    node2 = subprocess.Popen([sys.executable, "-c", DYING, plan.storage, str(marker)])
    try:
        while not marker.exists():
            assert node2.poll() is None, "the other host's study exited"
            time.sleep(0.1)
    finally:
        node2.kill()  # the host dies mid-trial
        node2.wait()
    dead = study.get_trials()[-1]
    node1 = objective(study, cfg, plan)
    sweep_until(node1, study, dead.number, 30)
    trials = study.get_trials()
    assert trials[dead.number].state.name == "FAIL"
    waiting = [t for t in trials if t.state.name == "WAITING"]
    assert len(waiting) == 1 and waiting[0].params == dead.params
    assert st.retry_of(waiting[0]) == dead.number
    assert heard == [dead.number]
    node1.last_sweep = 0.0
    node1.sweep()  # a second sweep finds nothing left to fail
    assert len([t for t in study.get_trials() if t.state.name == "WAITING"]) == 1


@pytest.mark.timeout(60)
def test_a_running_trial_with_no_heartbeat_is_failed_whatever_its_attributes_hold(tmp_path):
    """Optuna's sweep skips a trial that never beat (a client asked for it and died before
    running it, or a row someone wrote): it blocked every host's count ("full while trials [3]
    run; waiting", for ever). The study's own sweep fails it once the stale bound passed since a
    host first saw it, whatever its `enn.owner` holds: nothing, a string that is no record, or
    a record of a dead host. A trial that beats is left to its heartbeat."""
    from tests.fixtures.study import objective

    cfg = load_config(None, [LR, "tune.heartbeat_s=1", "tune.stale_after_s=2"])
    plan = shared_plan(tmp_path)
    study = st.open_study(cfg, plan)
    space = {d.key: d.distribution() for d in dimensions(cfg.tune)}
    with pytest.warns(UserWarning, match="Heartbeat of storage is supposed to be used"):
        orphans = [study.ask(space) for _ in range(3)]  # asked outside optimize: no heartbeat
    orphans[1].set_user_attr(OWNER_ATTR, "x")  # any string that is not a record
    orphans[2].set_user_attr(OWNER_ATTR, record("node2", plan.folder / "t" / "trial.json", 0))
    beats = study.ask(space)
    beats.set_user_attr(OWNER_ATTR, "x")
    stop = threading.Event()

    def its_host_beats() -> None:
        while not stop.is_set():
            study._storage.record_heartbeat(beats._trial_id)
            stop.wait(0.3)

    beating = threading.Thread(target=its_host_beats)
    beating.start()
    try:
        node1 = objective(study, cfg, plan)
        took = max(sweep_until(node1, study, t.number, 30) for t in orphans)
    finally:
        stop.set()
        beating.join()
    assert took <= cfg.tune.stale_after_s + 2 * cfg.tune.heartbeat_s
    states = [t.state.name for t in study.get_trials()]
    assert states[:4] == ["FAIL", "FAIL", "FAIL", "RUNNING"], states


def test_two_hosts_draw_different_points_and_a_point_queued_twice_runs_once(tmp_path):
    from tasks.tuning.objective import Ended
    from tests.fixtures.study import objective

    cfg = load_config(None, [LR, "tune.sampler=random"])
    dims = dimensions(cfg.tune)
    space = {d.key: d.distribution() for d in dims}
    draws = []
    for name in ("node1", "node2"):
        study = st.open_study(cfg, shared_plan(tmp_path, folder=name, identity=name))
        trial = study.ask(space)
        study.tell(trial, 1.0)
        draws.append(trial.params["train.lr"])
    assert draws[0] != draws[1]
    # both hosts enqueued the same point at once (skip_if_exists read before either wrote)
    study.enqueue_trial({"train.lr": 0.02})
    study.enqueue_trial({"train.lr": 0.02})
    first = study.ask(space)  # one host runs the first...
    study.tell(first, 1.0)
    study.optimize(objective(study, cfg, shared_plan(tmp_path)), n_trials=1, catch=(Ended,))
    twin = study.get_trials()[-1]  # ...the twin is not run
    assert twin.state.name == "FAIL" and twin.user_attrs[store.DUPLICATE_ATTR] == first.number
    assert not list((tmp_path / "s").glob("trial-*"))


def test_hosts_that_both_create_the_parent_run_keep_one(tmp_path, mlflow_uri):
    from mlflow.tracking import MlflowClient

    from tasks.tracking.study import StudyTracker

    (tmp_path / "params.yaml").write_text("{}\n")
    uri = mlflow_uri
    cfg = load_config(None, [f"tracking.uri={uri}"])
    layout = Layout.for_root(tmp_path)

    class Racing(StudyTracker):
        """A host whose first search ran before the other host's parent was made."""

        searched = 0

        def parents(self) -> list[str]:
            self.searched += 1
            return [] if self.searched == 1 else super().parents()

    client = MlflowClient(uri)
    racing = Racing(cfg, layout, "s")
    exp = client.get_experiment_by_name("enn").experiment_id
    early = client.create_run(  # the other host's, made between this host's search and create
        exp, run_name="tune s", tags={"enn.kind": "tune", "enn.tune.study": "s"}
    ).info.run_id
    assert racing.start({}) == early  # it made its own, found the earlier one, deleted its own
    assert StudyTracker(cfg, layout, "s").start({}) == early  # a third host joins it
    runs = client.search_runs([exp], "tags.`enn.kind` = 'tune'")
    assert [r.info.run_id for r in runs] == [early]


def test_a_relative_sqlite_storage_is_taken_from_the_project_root(tmp_path):
    default = tmp_path / "work" / "tune" / "s.db"
    assert st.storage_url("", tmp_path, default) == f"sqlite:///{default}"
    got = st.storage_url("sqlite:///studies/s.db?timeout=30", tmp_path, default)
    assert got == f"sqlite:///{tmp_path / 'studies' / 's.db'}?timeout=30"
    assert st.storage_url(SERVER, tmp_path, default) == SERVER


def test_mlflow_failing_mid_study_is_one_line_and_the_study_goes_on(tmp_path, caplog, mlflow_uri):
    """The study's experiment deleted while trials run: one warning, then tracking is off
    (each later call a no-op, none raises)."""
    from mlflow.tracking import MlflowClient

    from tasks.tracking.study import StudyTracker
    from tasks.tuning.objective import RunningTrial, TrialEnd

    (tmp_path / "params.yaml").write_text("{}\n")
    uri = mlflow_uri
    cfg = load_config(None, [f"tracking.uri={uri}", "tracking.experiment=gone"])
    tracker = StudyTracker(cfg, Layout.for_root(tmp_path), "s")
    assert tracker.start({}) is not None
    client = MlflowClient(uri)
    client.delete_experiment(client.get_experiment_by_name("gone").experiment_id)
    trial = RunningTrial(0, {}, tmp_path, time.monotonic())
    with caplog.at_level("WARNING", logger="enn.tune"):
        tracker.started(trial)
        tracker.reported(trial, 0, 0.5)
        tracker.ended(trial, TrialEnd(0, "complete", 0.5, {}, 1, 1.0))
        tracker.stale(3)
        tracker.finish(None, [], None)
    said = [r.getMessage() for r in caplog.records if r.name == "enn.tune"]
    assert len(said) == 1 and "the study goes on untracked" in said[0], said


def test_tune_after_its_experiment_was_deleted_is_one_line(tmp_path, mlflow_uri):
    """`enn tune` whose MLflow experiment was deleted (MLflow keeps its name, and refuses runs
    in it): one line naming it and what to do, before anything is staged or run (it was 100
    lines and 2 tracebacks). `enn` prints a ConfigError as that line, exit 2."""
    from mlflow.tracking import MlflowClient

    from enn_core.errors import ConfigError
    from enn_core.paths import Layout
    from tasks.tuning.objective import tune

    uri = mlflow_uri
    (tmp_path / "params.yaml").write_text("{}\n")
    cfg = load_config(None, [LR, f"tracking.uri={uri}", "tracking.experiment=deleted"])
    client = MlflowClient(uri)
    client.delete_experiment(client.create_experiment("deleted"))
    with pytest.raises(ConfigError) as e:
        tune(cfg, tmp_path / "params.yaml", [], Layout.for_root(tmp_path))
    said = str(e.value)
    assert "\n" not in said and "experiment 'deleted' (tracking.experiment) was deleted" in said
    assert "mlflow experiments restore" in said and "another tracking.experiment" in said
    assert not (tmp_path / "work" / "tune" / "params").exists()  # nothing staged or run


def test_threads_asking_at_once_each_claim_a_different_queued_trial(tmp_path):
    """`tune.parallel` threads of one `enn tune` ask for trials at the same moment: each queued
    point is claimed once (on SQLite, Optuna's row lock is no lock: one queued trial went to
    several threads, one removed the trial folder under the other, CI's SIGTERM round)."""
    import collections
    import threading

    import optuna

    from tasks.tuning.store import rdb_storage

    claimed: list[int] = []
    for rep in range(4):
        study = optuna.create_study(storage=rdb_storage(f"sqlite:///{tmp_path}/s{rep}.db"))
        for i in range(16):
            study.enqueue_trial({"x": float(i)})
        start = threading.Barrier(8)

        def ask(study=study, start=start) -> None:
            start.wait()
            claimed.extend(study.ask().number for _ in range(2))

        threads = [threading.Thread(target=ask) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        twice = {n: c for n, c in collections.Counter(claimed).items() if c > 1}
        assert not twice, f"queued trials claimed by more than one thread: {twice}"
        claimed.clear()


def test_a_count_that_falls_to_zero_is_logged_as_zero(tmp_path, mlflow_uri):
    """The first `enn tune` ends with an interrupted trial's point queued (tune/n_waiting 1);
    the next runs it: the parent's tune/n_waiting reads 0, not the stale 1 (walk-through)."""
    import optuna
    from mlflow.tracking import MlflowClient

    from tasks.tracking.study import StudyTracker

    (tmp_path / "params.yaml").write_text("{}\n")
    cfg = load_config(None, [f"tracking.uri={mlflow_uri}", "tracking.experiment=counts"])
    study = optuna.create_study()
    row = {"trial": 0, "value": 0.5, "epochs": 1, "seconds": 1.0, "train.lr": 0.01}
    first = [{**row, "state": "complete"}, {**row, "trial": 1, "state": "waiting"}]
    second = [*first[:1], {**row, "trial": 1, "state": "complete"}]
    for rows in (first, second):
        tracker = StudyTracker(cfg, Layout.for_root(tmp_path), "counts")
        parent = tracker.start({})
        tracker.finish(study, rows, None)
    metrics = MlflowClient(mlflow_uri).get_run(str(parent)).data.metrics
    assert metrics["tune/n_waiting"] == 0 and metrics["tune/n_complete"] == 2
    assert metrics["tune/n_fail"] == 0 and metrics["tune/n_running"] == 0
