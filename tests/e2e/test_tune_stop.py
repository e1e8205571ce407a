"""`enn tune` stopped and shared, end to end from the trained tiny project:

- Ctrl-C (SIGINT) and SIGTERM to `enn tune` while two trials train side by side: every process
  of both trials is gone within seconds, `enn tune` exits 130 / 143, and the console holds none
  of Optuna's lines (its trial lines and tracebacks are in the log file);
- two hosts (two checkouts, two `enn tune` with two trials each) on one storage: the study ends
  with at least n_trials and at most n_trials + hosts - 1 trials complete or pruned, and no
  point run twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_tune import alive, trial_tree, wait_for
from tests.fixtures.project import copy_project

pytestmark = pytest.mark.timeout(900)
SPACE = {"train.lr": {"low": 1e-4, "high": 0.03, "log": True}}


def study(proj, **tune) -> None:
    params = proj.root / "params.yaml"
    doc = yaml.safe_load(params.read_text())
    doc["tune"] = {"space": SPACE, "pruner": "none", "parallel": 2, **tune}
    params.write_text(yaml.safe_dump(doc, sort_keys=False))
    proj.git_commit("a study")


def test_ctrl_c_and_sigterm_end_running_trials_in_seconds_and_optuna_stays_off_the_console(
    trained_project, tmp_path
):
    proj = copy_project(trained_project.project, tmp_path / "proj")
    study(proj, n_trials=8)
    folder = proj.root / "work" / "tune" / "params"
    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        log = tmp_path / f"tune-{sig.name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                ["enn", "tune", "--set", "train.epochs=200"],
                cwd=proj.root,
                env=proj.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:

            def two_training() -> set[int] | None:
                running = [d for d in folder.glob("trial-*") if not (d / "end.json").exists()]
                pids = [trial_tree(d) for d in running]
                both = len(running) == 2 and all(len(p) >= 2 for p in pids)
                return set().union(*pids) if both else None

            pids = wait_for(two_training, 300, proc, log)
            pids |= wait_for(two_training, 10, proc, log)  # the workers started since
            t0 = time.monotonic()
            os.kill(proc.pid, sig)  # enn tune alone, as a terminal's Ctrl-C or a scheduler would
            assert proc.wait(60) == code, log.read_text()[-3000:]
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        assert not [p for p in pids if alive(p)], f"{sig.name}: trial processes outlived enn tune"
        assert took < 30, f"{sig.name}: enn tune took {took:.0f} s to stop its trials"
        console = log.read_text()
        assert "Traceback" not in console and "optuna" not in console.lower(), console[-3000:]
        assert "Trial " not in console, console[-3000:]  # Optuna's own trial lines
    logs = sorted((proj.root / "work" / "logs").glob("*-tune.log"))
    assert any("optuna" in p.read_text() for p in logs), "Optuna's lines are in no log file"
    import optuna

    loaded = optuna.load_study(study_name="params", storage=f"sqlite:///{folder}.db")
    states = [t.state.name for t in loaded.get_trials()]
    assert "RUNNING" not in states, states  # the stopped trials failed, their points queued
    assert states.count("WAITING") >= 2, states


def test_two_hosts_end_a_shared_study_within_n_trials_plus_hosts_minus_one(
    trained_project, tmp_path
):
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    hosts = [copy_project(trained_project.project, tmp_path / f"host{i}") for i in (1, 2)]
    for proj in hosts:
        study(proj, n_trials=3, storage=storage, study="shared", sampler="random")
    logs = [tmp_path / f"host{i}.log" for i in (1, 2)]
    procs = []
    for proj, log in zip(hosts, logs, strict=True):
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(
                    ["enn", "tune", "--set", "train.epochs=2"],
                    cwd=proj.root,
                    env=proj.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    try:
        codes = [p.wait(600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    import optuna

    trials = optuna.load_study(study_name="shared", storage=storage).get_trials()
    ended = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert 3 <= len(ended) <= 3 + len(hosts) - 1, [t.state.name for t in trials]
    ran = [t.params["train.lr"] for t in trials if "enn.not_run" not in t.user_attrs]
    assert len(ran) == len(set(ran)), ran
    owners = {json.loads(t.user_attrs["enn.owner"])["cmdline"][-1] for t in ended}
    assert {Path(o).parents[3] for o in owners} <= {p.root / "work" for p in hosts}
