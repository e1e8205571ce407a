"""A study database is data: it never chooses what is killed, what a trial runs or what
`--apply` writes.

- a resumed study signals nothing: whatever process a record names (the old `pid:start`
  record, another host, another study's trial, a reused pid, the trial it started itself:
  that one kills its own group when its study dies) is left alone;
- a trial runs only values of the config's own `tune.space` (a waiting trial in the database
  holding `model.factory` runs nothing; the host goes on with the next trial);
- `--apply` writes only keys of `tune.space`, each a point of it and valid as `--set`; else one
  line and the params file as it was;
- a damaged or foreign database is one line (exit 10 when it cannot be read as a study, 3
  when what it holds is not this project's study)."""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest
import yaml

from enn_core.config import load_config
from enn_core.config.tune import dimensions
from enn_core.errors import DataError, StoreError
from tasks.tuning import study as st
from tasks.tuning.store import OWNER_ATTR
from tests.fixtures.cli import enn
from tests.fixtures.study import study_plan

SPACE = {"train.lr": {"low": 0.001, "high": 0.1, "log": True}}
LR = f"tune.space={yaml.safe_dump(SPACE, default_flow_style=True).strip()}"
SLEEP = "import time; time.sleep(120)"


def spawn(*argv: str) -> subprocess.Popen:
    """A process of its own session that sleeps, with `argv` after its code (its command line)."""
    proc = subprocess.Popen([sys.executable, "-c", SLEEP, *argv], start_new_session=True)
    for _ in range(100):  # until it has exec'd
        if psutil.Process(proc.pid).cmdline()[1:2] == ["-c"]:
            break
        time.sleep(0.02)
    return proc


def alive(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


def record(proc: subprocess.Popen, **change) -> str:
    """An owner record naming `proc` (its pid and start too, as records of older studies did)."""
    p = psutil.Process(proc.pid)
    owner = {
        "host": socket.gethostname(),
        "pid": proc.pid,
        "started": p.create_time(),
        "cmdline": p.cmdline(),
        **change,
    }
    return json.dumps(owner)


def stale_trial(tmp_path: Path, attrs: dict[str, str]) -> tuple[object, st.StudyPlan]:
    """A study whose trial 0 a killed `enn tune` left RUNNING with these user attributes."""
    cfg = load_config(None, [LR])
    p = study_plan(tmp_path)
    study = st.open_study(cfg, p)
    trial = study.ask({"train.lr": dimensions(cfg.tune)[0].distribution()})
    for k, v in attrs.items():
        trial.set_user_attr(k, v)
    return st.open_study(cfg, p), p


def test_a_record_naming_another_process_leaves_it_alone(tmp_path):
    """Each record names a live process that is not this study's trial: none is signalled."""
    job = tmp_path / "s" / "trial-0" / "trial.json"
    bystander = spawn()  # someone's process, nothing to do with the study
    other_study = spawn("-m", "tasks.tuning.trial", str(tmp_path / "t" / "trial-0" / "trial.json"))
    looks_like = spawn("-m", "tasks.tuning.trial", str(job))  # the right command line
    p = psutil.Process(bystander.pid)
    records = [
        {"enn.pid": f"{bystander.pid}:{p.create_time()}"},  # the old record: pid and start
        {OWNER_ATTR: record(bystander)},  # start and command line right, but not a trial's
        {OWNER_ATTR: record(other_study)},  # another study's trial
        {OWNER_ATTR: record(looks_like, host="elsewhere")},  # another host's record
        {OWNER_ATTR: record(looks_like, started=1.0)},  # the pid was reused since
        {OWNER_ATTR: record(looks_like, pid=1)},
        {OWNER_ATTR: "{not json"},
    ]
    try:
        for attrs in records:
            folder = tmp_path / f"case{records.index(attrs)}"
            folder.mkdir()
            study, pl = stale_trial(folder, attrs)
            pl = st.StudyPlan(**{**pl.__dict__, "folder": tmp_path / "s"})
            assert st.end_stale_trials(study, pl) == [0]
            assert study.get_trials()[0].state.name == "FAIL"
            survivors = [alive(bystander), alive(other_study), alive(looks_like)]
            assert survivors == [True, True, True], attrs
    finally:
        for proc in (bystander, other_study, looks_like):
            proc.kill()
            proc.wait()


def test_the_trial_this_study_started_is_not_signalled_either(tmp_path):
    """Its process group dies with its study (the trial's parent watch); a resumed study marks
    it failed and queues its point again, and signals nothing."""
    p = study_plan(tmp_path)
    trial = spawn("-m", "tasks.tuning.trial", str(p.folder / "trial-0" / "trial.json"))
    try:
        study, _ = stale_trial(tmp_path, {OWNER_ATTR: record(trial)})
        assert st.end_stale_trials(study, p) == [0]
        assert alive(trial)
        assert [t.state.name for t in study.get_trials()] == ["FAIL", "WAITING"]
    finally:
        trial.kill()
        trial.wait()


def test_a_waiting_trial_of_foreign_keys_runs_nothing_and_the_host_goes_on(tmp_path):
    """A point queued in the database is data: one holding model.factory (or a value outside
    the space) is failed before any process starts or any folder is made, and the study's next
    trial is asked."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution
    from optuna.trial import TrialState, create_trial

    from tasks.tuning.objective import Ended
    from tasks.tuning.store import NOT_RUN_ATTR
    from tests.fixtures.study import objective

    cfg = load_config(None, [LR])
    p = study_plan(tmp_path)
    study = st.open_study(cfg, p)
    study.add_trial(
        create_trial(
            state=TrialState.WAITING,
            params={"model.factory": "examples.tcn.model:build", "train.lr": 0.01},
            distributions={
                "model.factory": CategoricalDistribution(["examples.tcn.model:build"]),
                "train.lr": FloatDistribution(0.001, 0.1, log=True),
            },
        )
    )
    study.enqueue_trial({"train.lr": 5.0})  # outside the space (Optuna only warns)
    study.optimize(objective(study, cfg, p), n_trials=2, catch=(Ended,))
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "FAIL"]
    assert all(t.user_attrs[NOT_RUN_ATTR] for t in trials) and not st.table(study)
    assert not list(p.folder.glob("trial-*"))


def project(tmp_path: Path) -> Path:
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "params.yaml").write_text(
        "# the study\ntrain:\n  lr: 0.003  # kept\ntune:\n"
        "  space:\n    train.lr: {low: 0.001, high: 0.1, log: true}\n"
        "    model.heads: {choices: [1, 2, 4]}\n"
    )
    return tmp_path / "work" / "tune" / "params.db"


def best_trial(db: Path, params: dict, distributions: dict, value: float = 0.5) -> None:
    from optuna.trial import TrialState, create_trial

    db.parent.mkdir(parents=True, exist_ok=True)
    study = optuna.create_study(study_name="params", storage=f"sqlite:///{db}", load_if_exists=True)
    study.add_trial(
        create_trial(
            state=TrialState.COMPLETE, value=value, params=params, distributions=distributions
        )
    )


def test_apply_writes_only_points_of_the_space(tmp_path):
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    db = project(tmp_path)
    params = tmp_path / "params.yaml"
    before = params.read_bytes()
    lr = FloatDistribution(1e-6, 10.0, log=True)
    cases = [  # (best trial's values, the one line, exit code)
        (
            {"tracking.uri": "http://203.0.113.9"},
            "holds tracking.uri='http://203.0.113.9', which no study searches",
            3,
        ),
        ({"train.lr": 0.01, "train.epochs": 500}, "holds train.epochs, which is not a key", 3),
        ({"train.lr": 5.0}, "holds train.lr=5.0, outside tune.space.train.lr", 3),
        ({"model.heads": 3}, "holds model.heads=3, outside tune.space.model.heads", 3),
    ]
    for values, why, code in cases:
        db.unlink(missing_ok=True)
        dists = {
            k: lr if k == "train.lr" else CategoricalDistribution([v]) for k, v in values.items()
        }
        best_trial(db, values, dists)
        got, lines = enn(tmp_path, "tune", "--apply")
        assert got == code and len(lines) == 1 and why in lines[0], (values, lines)
        assert params.read_bytes() == before
    db.unlink()
    best_trial(
        db,
        {"train.lr": 0.02, "model.heads": 2},
        {"train.lr": lr, "model.heads": CategoricalDistribution([1, 2, 4])},
    )
    got, lines = enn(tmp_path, "tune", "--apply")
    assert got == 0, lines
    cfg = load_config(params)
    assert cfg.train.lr == 0.02 and cfg.model.heads == 2 and "# kept" in params.read_text()


def test_apply_refuses_values_the_config_refuses(tmp_path):
    """Inside the space but invalid together with the file's other values (heads must divide
    d_model): one line saying the study's values were refused, nothing written."""
    from optuna.distributions import CategoricalDistribution

    db = project(tmp_path)
    params = tmp_path / "params.yaml"
    params.write_text(params.read_text() + "model:\n  d_model: 6\n  heads: 2\n")
    params.write_text(params.read_text().replace("[1, 2, 4]", "[1, 2, 4, 6]"))
    before = params.read_bytes()
    best_trial(db, {"model.heads": 4}, {"model.heads": CategoricalDistribution([1, 2, 4, 6])})
    got, lines = enn(tmp_path, "tune", "--apply")
    assert got == 3 and len(lines) == 1, lines
    assert "best trial 0's values are refused by the config" in lines[0] and "nothing" in lines[0]
    assert params.read_bytes() == before


def garbage(db: Path) -> None:
    db.write_bytes(b"not a database at all " * 50)


def foreign(db: Path) -> None:
    with sqlite3.connect(db) as con:  # another program's SQLite file: Optuna added its tables
        con.execute("create table experiments (id integer)")


def truncated(db: Path) -> None:
    study = optuna.create_study(study_name="params", storage=f"sqlite:///{db}")
    for i in range(30):
        study.enqueue_trial({"train.lr": 0.001 + i / 1000})
    db.write_bytes(db.read_bytes()[: db.stat().st_size // 2])


def bad_record(db: Path) -> None:
    best_trial(
        db, {"train.lr": 0.01}, {"train.lr": optuna.distributions.FloatDistribution(0.001, 0.1)}
    )
    with sqlite3.connect(db) as con:
        con.execute("update trial_params set distribution_json = '{not json'")


def maximizing(db: Path) -> None:
    optuna.create_study(study_name="params", storage=f"sqlite:///{db}", direction="maximize")


def directory(db: Path) -> None:
    db.mkdir()


def text_number(db: Path) -> None:
    """SQLite keeps text in an integer column: a trial 'numbered' a path named its folder."""
    study = optuna.create_study(study_name="params", storage=f"sqlite:///{db}")
    study.enqueue_trial({"train.lr": 0.01})
    with sqlite3.connect(db) as con:
        con.execute("update trials set number = '../../../../victim'")


@pytest.mark.parametrize(
    ("damage", "code", "why"),
    [
        (garbage, 10, "not an SQLite database"),
        (foreign, 10, "another program's database"),
        (truncated, 10, "cannot be read"),
        (bad_record, 10, "the study database cannot be read (JSONDecodeError"),
        (maximizing, 3, "maximizes its objective"),
        (directory, 10, "not a file"),
        (text_number, 3, "a trial numbered '../../../../victim'"),
    ],
)
def test_a_damaged_or_foreign_database_is_one_line(tmp_path, damage, code, why):
    db = project(tmp_path)
    db.parent.mkdir(parents=True)
    damage(db)
    got, lines = enn(tmp_path, "tune", "--apply")
    assert got == code and len(lines) == 1 and why in lines[0], lines
    assert "name another study (--set tune.study=NAME)" in lines[0]
    cfg = load_config(tmp_path / "params.yaml")
    p = st.StudyPlan(
        **{**study_plan(tmp_path).__dict__, "name": "params", "storage": f"sqlite:///{db}"}
    )
    with pytest.raises((StoreError, DataError), match=why.split(" (")[0]):
        st.open_study(cfg, p)  # what `enn tune` opens first


def test_apply_writes_what_the_best_trial_ran_in_a_few_digits_and_nothing_else(tmp_path):
    """Optuna samples floats with all their digits: `--apply` wrote `lr: 0.002358412537954837`
    and `huber_delta: 0.30000000000000004` (a step of 0.1), and re-indented the file's lists
    (issue 32). A trial runs its sampled floats to 4 digits (a stepped one to the step), and
    `--apply` writes those very floats, each where it stands."""
    from optuna.distributions import FloatDistribution

    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    params = tmp_path / "params.yaml"
    params.write_text(
        "train:\n  lr: 0.003        # kept, aligned\n  huber_delta: 1.0\n"
        "tune:\n  space:\n    train.lr: {low: 0.001, high: 0.1, log: true}\n"
        "    train.huber_delta: {low: 0.1, high: 2.0, step: 0.1}\n"
        "  enqueue:\n    - {train.lr: 0.003, train.huber_delta: 1.0}\n"
    )
    before = params.read_text()
    sampled = {"train.lr": 0.0023584125379548373, "train.huber_delta": 0.1 + 0.2}
    dists = {
        "train.lr": FloatDistribution(0.001, 0.1, log=True),
        "train.huber_delta": FloatDistribution(0.1, 2.0, step=0.1),
    }
    best_trial(tmp_path / "work" / "tune" / "params.db", sampled, dists)
    got, lines = enn(tmp_path, "tune", "--apply")
    assert got == 0, lines
    old, new = before.splitlines(keepends=True), params.read_text().splitlines(keepends=True)
    assert [(a, b) for a, b in zip(old, new, strict=True) if a != b] == [
        ("  lr: 0.003        # kept, aligned\n", "  lr: 0.002358        # kept, aligned\n"),
        ("  huber_delta: 1.0\n", "  huber_delta: 0.3\n"),
    ]
    from enn_core.config.tune import points

    ran = points(sampled, dimensions(load_config(params).tune))  # what its trial's --set held
    assert [st.override(k, v) for k, v in ran.items()] == [
        "train.lr=0.002358",
        "train.huber_delta=0.3",
    ]
    cfg = load_config(params)
    assert (cfg.train.lr, cfg.train.huber_delta) == (ran["train.lr"], ran["train.huber_delta"])
