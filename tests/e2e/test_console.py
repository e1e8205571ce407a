"""What a person sees while enn runs, and how its commands treat params.yaml.

- In a terminal (a pseudo-terminal), training prints one line per epoch while it trains, and a
  progress bar with the loss.
- dvc.yaml's commands run with DVC called by its path, without an activated environment.
- `enn <stage> --set` and `enn run --set` write the pipeline's parameters into params.yaml
  the same way, leave runtime settings out of it, and a failed run leaves it as it was.

The console allow-list over a whole training flow is in test_models_in_mlflow.py (it reuses
that module's trainings).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_cancel import last_message, start_in_terminal
from tests.fixtures.project import Project, make_project

pytestmark = pytest.mark.timeout(600)
STAGES = ("stage-data", "prepare-checkpoint", "distributed-train")
EPOCH = re.compile(rb"distributed-train: epoch (\d+)/(\d+) +train loss")


@pytest.fixture(scope="module")
def proj(tmp_path_factory, prefect_home_shared) -> Project:
    return make_project(
        tmp_path_factory.mktemp("console") / "proj", prefect_home_shared, stages=STAGES
    )


def test_a_terminal_sees_each_epoch_while_it_trains(proj):
    slow = ["fault.kind=delay", "fault.phase=step", "fault.seconds=0.3", "fault.times=100000"]
    sets = ["train.epochs=6", "tracking.enabled=false", "runtime.progress=true", *slow]
    args = [a for o in sets for a in ("--set", o)]
    proc, master, seen = start_in_terminal(proj, "run", "--until", "distributed-train", *args)
    arrivals: dict[int, float] = {}
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        for m in EPOCH.finditer(b"".join(seen)):
            arrivals.setdefault(int(m.group(1)), time.time())
        time.sleep(0.1)
    proc.wait(60)
    text = b"".join(seen).decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    done = re.search(r"distributed-train: ran in", text)
    assert done and len(arrivals) == 6, text[-3000:]
    # the epoch lines arrived while training ran, not together at its end
    events = next((proj.root / "work" / "runs").glob("*/distributed-train/events.jsonl"))
    written = {
        int(r["fields"]["epoch"]) + 1: r["time"]
        for r in map(json.loads, events.read_text().splitlines())
        if r.get("type") == "event" and r.get("name") == "epoch"
    }
    latency = [arrivals[e] - written[e] for e in sorted(written)]
    print(f"epoch line latency (written by rank 0 -> on the terminal): {latency}")
    assert arrivals[2] < written[6], "epoch 2 only showed after the last epoch was written"
    assert text.index("epoch 2/6") < text.index("distributed-train: ran in")
    # each epoch line fits 110 columns (issue 39: 121-123 characters wrapped in 120)
    lines = [
        ln for ln in text.replace("\r", "\n").splitlines() if "distributed-train: epoch " in ln
    ]
    assert lines and all(len(ln.strip()) <= 110 for ln in lines), lines
    # a bar with the loss in the terminal
    assert re.search(r"distributed-train:\s+\d+%.*loss \d", text), text[-2000:]


def test_dvc_runs_the_stages_without_an_activated_environment(proj, tmp_path):
    venv_bin = proj.root / ".venv" / "bin"  # as scripts/setup.sh makes it
    venv_bin.mkdir(parents=True, exist_ok=True)
    (venv_bin / "enn").symlink_to(Path(sys.executable).parent / "enn")
    env = {**proj.env, "PATH": "/usr/bin:/bin"}  # no environment activated: no enn on PATH
    assert shutil.which("enn", path=env["PATH"]) is None
    dvc = str(Path(sys.executable).parent / "dvc")
    out = Project(proj.root, env).run(
        dvc, "repro", "--force", "--single-item", "stage_data", timeout=300
    )
    assert "Running stage 'stage_data'" in out.stdout, out.stdout + out.stderr
    assert (proj.root / "outputs" / "stage-data" / "manifest.json").is_file()


def test_set_writes_the_pipelines_parameters_the_same_way_and_a_failure_none(proj):
    params = proj.root / "params.yaml"
    out = proj.run("enn", "stage-data", "--set", "data.val_fraction=0.2", "--set", "runtime.seed=3")
    text = params.read_text()
    assert "val_fraction: 0.2" in text and "seed: 3" not in text.split("runtime:")[1]
    assert "runtime.seed=3 for this run only" in out.stderr, out.stderr
    for argv in (["stage-data"], ["run", "--until", "stage-data"]):
        before = params.read_bytes()
        sets = ["data.val_fraction=0.3", "data.source=npy", "data.path=missing.npy"]
        bad = proj.run("enn", *argv, *[a for o in sets for a in ("--set", o)], check=False)
        assert bad.returncode == 3, bad.stderr[-2000:]
        assert params.read_bytes() == before, argv
    proj.run("enn", "run", "--until", "stage-data", "--set", "data.val_fraction=0.25")
    assert "val_fraction: 0.25" in params.read_text()


def test_a_stopped_config_run_says_what_the_same_command_runs_again_and_it_does(proj):
    """Issue 39: after a stop, a --config run's message said finished stages are skipped and
    training continues from its last checkpoint; the same command re-ran every stage. Now the
    message says so, and a training stopped mid-way continues from its checkpoint."""
    import signal
    import subprocess

    shutil.copy(proj.root / "params.yaml", proj.root / "configs-own.yaml")
    slow = ["fault.kind=delay", "fault.phase=step", "fault.seconds=0.4", "fault.times=100000"]
    sets = ["train.epochs=5", "tracking.enabled=false", *slow]
    argv = ["enn", "run", "--config", "configs-own.yaml", "--until", "distributed-train"]
    argv += [a for o in sets for a in ("--set", o)]
    log = proj.root / "stopped.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, cwd=proj.root, env=proj.env, stdout=f, stderr=f)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if "epoch 2/5" in log.read_text():
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)
    said = log.read_text()
    assert proc.returncode == 143, said[-3000:]
    last = last_message(said)
    assert "the same command runs every stage again" in last, last
    assert "continues from its last checkpoint if it was stopped mid-training" in last, last
    again = proj.run(*argv, timeout=600)
    text = again.stdout + again.stderr
    for stage in ("stage-data", "prepare-checkpoint", "distributed-train"):
        assert re.search(rf"^{stage} +ran +[0-9.]+ s +executed", again.stdout, re.M), text[-3000:]
    assert "distributed-train: resumed from step-" in text, text[-3000:]
    assert "epoch 1/5" not in text, text[-3000:]


def test_a_tracking_servers_view_run_lines_stay_off_the_console(proj, tmp_path):
    """Issue 39: with a tracking server, MLflow printed "View run ... at: URL" and "View
    experiment at: URL" for every stage and trial; the log file keeps each run's URL."""
    from flows.servers import mlflow_server

    store = tmp_path / "store"
    store.mkdir()
    uri = f"sqlite:///{store / 'mlflow.db'}"
    with mlflow_server(uri, store / "artifacts", "127.0.0.1", 0, tmp_path / "mlflow.log") as url:
        sets = [f"tracking.uri={url}", "data.split_seed=7"]  # another split: stage-data runs
        argv = [a for o in sets for a in ("--set", o)]
        out = proj.run("enn", "run", "--until", "stage-data", *argv, timeout=600)
    text = out.stdout + out.stderr
    assert "View run" not in text and "View experiment" not in text, text[-3000:]
    logged = re.search(r"^log: (\S+)", out.stdout, re.M)
    assert logged, out.stdout
    kept = Path(logged.group(1)).read_text()
    assert re.search(rf"MLflow run \w+ FINISHED: {re.escape(url)}/#/experiments/", kept), kept[
        -2000:
    ]
