"""`enn tune` end to end, from the trained tiny project: a study of three tiny trials with a
median pruner that may prune once one trial completed; the pruned trial's processes are gone
within 10 s (by pid); the study is SIGKILLed mid-trial and resumed; `--apply` writes the best
values into params.yaml and `dvc repro` trains them; MLflow's `tune params` parent holds the
trials as children, and the tuning flow run the study's table as an artifact."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tasks.tuning.trial import events_file
from tests.fixtures.project import copy_project

pytestmark = pytest.mark.timeout(900)

# trial 0: a good rate; trial 1: a rate that barely moves the model, so its epoch-1 validation
# loss is worse than trial 0's (the median of one completed trial) and it is pruned there;
# trial 2: sampled (TPE's random start).
STUDY = {
    "space": {"train.lr": {"low": 1e-6, "high": 0.03, "log": True}},
    "n_trials": 3,
    "sampler": "tpe",
    "seed": 0,
    "pruner": "median",
    "n_startup_trials": 1,
    "n_warmup_steps": 1,
    "parallel": 1,
    "enqueue": [{"train.lr": 0.02}, {"train.lr": 1e-6}],
}
SETS = ("--set", "train.epochs=6", "--set", "train.patience=0")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(what, timeout: float, proc: subprocess.Popen, log: Path):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"enn tune exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s:\n{log.read_text()[-4000:]}")


def trial_tree(folder: Path) -> set[int]:
    """The pids of the trial process running `folder` and its descendants."""
    out: set[int] = set()
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if any(str(folder / "trial.json") == c for c in cmd):
            try:
                out |= {p.pid, *(c.pid for c in p.children(recursive=True))}
            except psutil.NoSuchProcess:
                pass
    return out


def test_tune_prunes_resumes_applies_and_repro(trained_project, tmp_path):
    proj = copy_project(trained_project.project, tmp_path / "proj")
    params = proj.root / "params.yaml"
    doc = yaml.safe_load(params.read_text())
    doc["tune"] = STUDY
    params.write_text(yaml.safe_dump(doc, sort_keys=False))
    proj.git_commit("a study")
    study = proj.root / "work" / "tune" / "params"
    lock_before = (proj.root / "dvc.lock").read_bytes()

    # 1. the study until trial 2 runs; trial 1's processes watched by pid while it trains
    log = tmp_path / "tune-1.log"
    with open(log, "w") as out:
        first = subprocess.Popen(
            ["enn", "tune", *SETS],
            cwd=proj.root,
            env=proj.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        seen: set[int] = set()

        def pruned() -> dict | None:
            seen.update(trial_tree(study / "trial-1"))
            end = study / "trial-1" / "end.json"
            return json.loads(end.read_text()) if end.is_file() else None

        end1 = wait_for(pruned, 300, first, log)
        t_pruned = time.monotonic()
        assert end1["state"] == "pruned", end1
        pids = seen | set(end1["pids"])
        assert len(pids) >= 2, f"a trial and its worker at least: {pids}"
        while any(alive(p) for p in pids) and time.monotonic() - t_pruned < 10:
            time.sleep(0.1)
        assert not [p for p in pids if alive(p)], "pruned trial's processes outlived 10 s"
        assert end1["gone_s"] < 10
        assert json.loads((study / "trial-0" / "end.json").read_text())["state"] == "complete"
        wait_for(lambda: events_file(study / "trial-2").is_file(), 120, first, log)
        killed = trial_tree(study / "trial-2")
        os.killpg(first.pid, signal.SIGKILL)  # the study dies mid-trial
        first.wait(30)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10  # the orphaned trial kills its own group
    while any(alive(p) for p in killed) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in killed if alive(p)], "the killed study's trial trained on"

    # 2. resume: the interrupted trial failed and enqueued again; three trials end
    out = proj.run("enn", "tune", *SETS, timeout=600)
    text = out.stdout + out.stderr
    assert "trials [2] were interrupted" in text, text[-3000:]
    assert "2 of 3 trials done" in text, text[-3000:]
    trials_only = "params: params.yaml unchanged (train.epochs=6 train.patience=0 for this study's"
    assert trials_only in out.stdout, out.stdout[-2000:]
    import optuna

    loaded = optuna.load_study(study_name="params", storage=f"sqlite:///{study}.db")
    states = [t.state.name for t in loaded.get_trials()]
    assert states[:3] == ["COMPLETE", "PRUNED", "FAIL"], states
    assert sum(s in ("COMPLETE", "PRUNED") for s in states) == 3, states
    assert loaded.get_trials()[3].params == loaded.get_trials()[2].params  # the same point again
    assert not list(study.glob("trial-*/work/checkpoints")), "a trial kept its checkpoints"
    assert not list(study.glob("trial-*/outputs/*/*.pt"))

    assert (proj.root / "dvc.lock").read_bytes() == lock_before  # trials write no dvc.lock
    assert yaml.safe_load(params.read_text())["train"] == doc["train"]  # nor params.yaml

    # 3. the best values into params.yaml, then dvc repro trains them
    applied = proj.run("enn", "tune", "--apply")
    said = applied.stdout + applied.stderr
    # the trials trained 6 epochs, params.yaml says otherwise: read from the study itself
    assert "note: the study ran with --set train.epochs=6" in said, said
    from enn_core.config import load_config
    from enn_core.config.tune import dimensions, points

    best = loaded.best_params["train.lr"]  # as Optuna sampled it; its trial ran it to 4 digits
    ran = points(loaded.best_params, dimensions(load_config(params).tune))["train.lr"]
    assert ran == pytest.approx(best, rel=1e-3)
    assert yaml.safe_load(params.read_text())["train"]["lr"] == ran
    proj.run("dvc", "repro", timeout=900)
    trained = json.loads((proj.root / "outputs" / "distributed-train" / "params.json").read_text())
    assert trained["train"]["lr"] == ran
    status = proj.run("dvc", "status").stdout  # the training pipeline's stages: up to date
    assert not re.findall(r"^[a-z_]+:", status, re.M), status  # (prediction/ never ran here)

    # 4. MLflow: the study's parent holds the trials as children
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{proj.root / 'work' / 'mlflow' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("enn")
    parents = client.search_runs([exp.experiment_id], "tags.`enn.kind` = 'tune'")
    assert [r.info.run_name for r in parents] == ["tune params"]
    parent = parents[0]
    children = client.search_runs(
        [exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    by_name = {r.info.run_name: r for r in children}
    assert {"trial 0", "trial 1", "trial 2", "trial 3"} <= set(by_name), sorted(by_name)
    assert by_name["trial 0"].data.tags["enn.tune.state"] == "complete"
    assert by_name["trial 1"].data.tags["enn.tune.state"] == "pruned"
    assert "epoch/val_loss" in by_name["trial 0"].data.metrics
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["tune/best_value"] == pytest.approx(loaded.best_value)
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "tune")}
    assert {"tune/trials.csv", "tune/trials.json"} <= artifacts
    plots = {a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
    assert "plots/optimization_history.png" in plots

    # 5. Prefect: the study's table (trials, values, objective, state) as a table artifact
    import sqlite3

    with sqlite3.connect(Path(proj.env["PREFECT_HOME"]) / "prefect.db") as con:
        found = con.execute(
            "SELECT data FROM artifact WHERE key = 'tune-params' AND type = 'table' "
            "ORDER BY created DESC"
        ).fetchall()
    assert found, "no tune-params table artifact"
    table = json.loads(json.loads(found[0][0]))
    assert [r["state"] for r in table][:3] == ["complete", "pruned", "fail"], table
    assert {"trial", "value", "train.lr"} <= set(table[0])
