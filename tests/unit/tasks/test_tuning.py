"""The study's pieces without training: slots never oversubscribe, the events watcher reads
`epoch/<metric>` as it is appended, a pruned trial's process group is gone after kill_trial, and
a study killed mid-trial is resumed with the trial failed and enqueued again."""

from __future__ import annotations

import json
import sys
import time

import psutil
import pytest

from enn_core.config import load_config
from enn_core.runtime import children
from enn_core.runtime.parent import descendants
from tasks.tuning import study as st
from tasks.tuning.objective import RunningTrial, kill_trial
from tasks.tuning.store import OWNER_ATTR, TrialOwner
from tasks.tuning.trial import events_file
from tests.fixtures.study import study_plan

LR = 'tune.space={"train.lr": {"low": 0.001, "high": 0.1, "log": true}}'


@pytest.mark.parametrize(
    ("sets", "cores", "want"),
    [
        ([], 2, (2, 1)),  # two one-thread trials on two cores
        (["tune.parallel=1"], 2, (1, 2)),  # one trial gets both
        (["tune.parallel=8"], 2, (2, 1)),  # never more than the cores
        (["runtime.world_size=2"], 2, (1, 1)),
        (["runtime.threads_per_worker=4"], 2, (1, 4)),
    ],
)
def test_slots_never_oversubscribe(sets, cores, want):
    cfg = load_config(None, [LR, *sets])
    assert st.slots(cfg, cores, gpus=0) == want


def test_slots_one_trial_per_gpu():
    cfg = load_config(None, [LR])
    assert st.slots(cfg, 16, gpus=4) == (4, 4)


def _running(tmp_path):
    return RunningTrial(number=0, params={}, folder=tmp_path, started=time.monotonic())


def test_watcher_reads_epoch_values_as_appended(tmp_path):
    path = events_file(tmp_path)
    path.parent.mkdir(parents=True)
    running = _running(tmp_path)
    assert running.new_values("val_loss") == []
    rec = {"type": "metric", "name": "epoch/val_loss", "value": 0.5, "step": 0}
    other = {"type": "metric", "name": "epoch/train_loss", "value": 9.0, "step": 0}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n" + json.dumps(other) + "\n")
        f.write('{"type": "metric", "name": "epoch/val_loss", "val')  # a line half written
    assert running.new_values("val_loss") == [(0, 0.5)]
    with open(path, "a") as f:
        f.write('ue": 0.25, "step": 1}\n')
    assert running.new_values("val_loss") == [(1, 0.25)]
    assert running.values == [(0, 0.5), (1, 0.25)]


def test_kill_tree_ends_the_group_and_its_children():
    code = (
        "import subprocess, sys, time; "
        "sleep = [sys.executable, '-c', 'import time; time.sleep(60)']; "
        "[subprocess.Popen(sleep) for _ in range(2)]; "
        "time.sleep(60)"
    )
    child = children.start("trial", [sys.executable, "-c", code], session=True)
    proc = child.proc
    for _ in range(100):
        if len(descendants(proc.pid)) == 2:
            break
        time.sleep(0.05)
    pids, took = kill_trial(child)
    assert proc.returncode is not None
    assert len(pids) == 3 and took < 10
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_stale_running_trial_is_failed_and_enqueued_again(tmp_path):
    import optuna

    cfg = load_config(None, [LR, "tune.n_trials=2"])
    plan = study_plan(tmp_path)
    study = st.open_study(cfg, plan)
    left = study.ask({"train.lr": optuna.distributions.FloatDistribution(0.001, 0.1, log=True)})
    gone = TrialOwner("here", ("python", "-m", "tasks.tuning.trial", "x"))
    left.set_user_attr(OWNER_ATTR, gone.to_json())  # its process is gone
    again = st.open_study(cfg, plan)  # the next `enn tune`
    assert st.end_stale_trials(again, plan) == [left.number]
    states = [t.state.name for t in again.get_trials()]
    assert states == ["FAIL", "WAITING"]
    assert again.get_trials()[1].params == left.params


@pytest.mark.parametrize("value", [1e-06, 0.02, 3, "huber", True])
def test_a_trial_value_reaches_the_config_as_itself(value):
    from enn_core.config.loader import parse_override

    assert parse_override(st.override("train.lr", value)) == ("train.lr", value)


def test_a_study_refuses_other_data_settings(tmp_path):
    from enn_core.config import ConfigError

    cfg = load_config(None, [LR])
    plan = study_plan(tmp_path)
    st.open_study(load_config(None, [LR, "data.split_seed=7"]), plan)  # it ran on other splits
    with pytest.raises(ConfigError, match=r"data.split_seed differs\); name a new study"):
        st.open_study(cfg, plan)


def test_a_resumed_study_draws_new_points_not_its_first_runs_again(tmp_path):
    """`enn tune` run again on a study (more trials, or after an interruption) must not
    repeat the random points its first run drew from the same seed."""
    import optuna

    cfg = load_config(None, [LR, "tune.n_trials=4"])
    plan = study_plan(tmp_path)
    space = {"train.lr": optuna.distributions.FloatDistribution(0.001, 0.1, log=True)}

    def draw_two() -> list[float]:
        study = st.open_study(cfg, plan)
        out = []
        for _ in range(2):
            trial = study.ask(space)
            study.tell(trial, 1.0)
            out.append(trial.params["train.lr"])
        return out

    first, second = draw_two(), draw_two()  # the second: the next `enn tune`
    assert not set(first) & set(second), (first, second)


def test_a_trials_console_line_shows_four_digits_and_runs_the_exact_value():
    """Issue 32: tuning's console lines showed 18-digit floats (`train.lr=0.011734567891234567`)."""
    values = {"train.lr": 0.011734567891234567, "model.layers": 2, "train.loss": "huber"}
    assert st.shown(values) == "model.layers=2 train.loss=huber train.lr=0.01173"
    assert st.override("train.lr", values["train.lr"]) == "train.lr=0.011734567891234567"
