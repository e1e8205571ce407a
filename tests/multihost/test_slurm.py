"""The pipeline on a real scheduler: SLURM's daemons in the test bed (tests/fixtures/slurm.py:
slurmctld on node3, slurmd on node1 and node2, munged everywhere) and the batch scripts of
deploy/slurm/ submitted with sbatch as written, from node1's checkout, with only their
documented variables set.

One training job serves the pipeline, a dead host and preemption: node2 killed mid-epoch (the
job requeued after SlurmdTimeout, resumed once node2's slurmd is back), then the time-limit
warning (`scancel --batch --signal=USR2`, what `--signal=B:USR2@<grace>` sends: the workers
save a committed checkpoint at the step they agree on, the script requeues the job); the
third run resumes from that save and ends with weights bit-identical to the uninterrupted job
on one host (the tier's `reference`), then runs the later stages on node1. Every `enn` of the
job records under one MLflow parent run on the tier's tracking server (PostgreSQL-backed,
basic authentication), where export registers the model; the prediction job then takes it
from the registry (`champion`) on every node."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from flows.params_file import apply_overrides
from tasks.tuning.study import override
from tasks.tuning.trial import events_file
from tests.fixtures.multihost import Job, published_model, same_weights
from tests.fixtures.project import ROOT
from tests.fixtures.slurm import FINAL, Slurm, missing, parse_show
from tests.multihost.conftest import unavailable

pytestmark = pytest.mark.timeout(600)

TRAIN = "deploy/slurm/train.sbatch"
PREDICT = "deploy/slurm/predict.sbatch"
TUNE = "deploy/slurm/tune.sbatch"
ARRAY_STUDY, ARRAY_TRIALS = "array", 2
TRAIN_EXPERIMENT = "slurm-train"
DUMP_JOB = """
import json, sys
from mlflow.tracking import MlflowClient
c = MlflowClient(tracking_uri=sys.argv[1])
exp = c.get_experiment_by_name(sys.argv[2])
runs = c.search_runs([exp.experiment_id], f"tags.`enn.slurm.job_id` = '{sys.argv[3]}'",
                     max_results=500)
models = []
for m in c.search_registered_models():
    champion = m.aliases.get("champion")
    run = c.get_model_version(m.name, champion).run_id if champion else None
    models.append({"name": m.name, "champion": champion, "run": run})
print(json.dumps({
    "runs": [{"id": r.info.run_id, "status": r.info.status, "kind": r.data.tags.get("enn.kind"),
              "stage": r.data.tags.get("enn.stage"), "host": r.data.tags.get("enn.host"),
              "parent": r.data.tags.get("mlflow.parentRunId")} for r in runs],
    "models": models,
}))
"""
DUMP_TRIALS = """
import json, sys, optuna
study = optuna.load_study(study_name=sys.argv[2], storage=sys.argv[1])
print(json.dumps([{"number": t.number, "state": t.state.name, "user_attrs": t.user_attrs,
                   "params": t.params} for t in study.get_trials()]))
"""
# rank 1 (node2) pauses at step 6 (epoch 1, step 1). The newest periodic checkpoint then is step
# 6 (every 2 steps; epoch ends at 5, 10); the save the workers agree on after a warning is at
# step 7, which no periodic save makes.
PAUSE_STEP, SAVED_AT = 6, "step-00000007"
# The template's 3 epochs (the reference's) make a model too young for collapse-check's bars;
# the job's later stages are checked for running where they should, not for model quality.
LENIENT = [
    "collapse.median_ratio_min=0.0",
    "collapse.p10_ratio_min=0.0",
    "collapse.max_flat_fraction=1.0",
    "collapse.max_broadcast_fraction=1.0",
    "collapse.min_correlation=-1.0",
]


@pytest.fixture(scope="module")
def slurm(testbed, say):
    unavailable(missing())
    for h in testbed.hosts:  # the checkouts as a cluster has them: with deploy/
        shutil.copytree(ROOT / "deploy", h.checkout / "deploy", dirs_exist_ok=True)
    started = Slurm.start(testbed, testbed.bed.base / "slurm")
    say(f"SLURM: slurmctld on {started.ctld.name}, slurmd on {[h.name for h in started.computes]}")
    try:
        yield started
    finally:
        started.stop()


def _restore(path):
    before = path.read_bytes()
    return lambda: path.write_bytes(before)


def _log_of(host, job: str) -> str:
    path = host.checkout / f"enn-train-{job}.out"
    return path.read_text(errors="replace") if path.exists() else "(no output file)"


@pytest.mark.timeout(900)  # with the tier's reference run, when it runs first
def test_the_training_job_survives_a_dead_host_and_a_time_limit_and_ends_bit_identical(
    testbed, slurm, reference, mlflow, prefect, say, request, monkeypatch
):
    """One training job, two interruptions: node2 dies mid-epoch (every process of its
    namespace, slurmd included), SLURM notices after SlurmdTimeout and requeues the job, which
    waits until node2's slurmd is back and resumes from the newest periodic checkpoint; then,
    paused at the same step again, the time-limit warning: the workers save at the step they
    agree on, the script requeues the job, the third run resumes from that save. The weights
    equal the uninterrupted job's on one host, bit for bit. On the tracking server: one parent
    run for the job (every node's, step's and run's `enn` under it), the model registered and
    champion. The job reports to the tier's Prefect server (PREFECT_API_URL and
    PREFECT_API_AUTH_STRING exported, as docs/scale-out.md says): each node's flow run is in its
    PostgreSQL, named with its host. The nodes' lines carry srun's task number. An edit of
    params.yaml while the job is requeued is named by the next run."""
    node1, node2 = testbed.hosts[:2]
    shared = testbed.shared
    pause = [  # rank 1 (node2) pauses twice at step 6: killed in the first, warned in the second
        "fault.kind=delay",
        "fault.phase=step",
        f"fault.step={PAUSE_STEP}",
        "fault.rank=1",
        "fault.times=2",
        "fault.seconds=15",
        f"fault.marker_dir={shared / 'faults-slurm'}",
        *LENIENT,
        f"tracking.uri={mlflow}",
        f"tracking.experiment={TRAIN_EXPERIMENT}",
    ]
    monkeypatch.setenv("ENN_ALLOW_FAULTS", "1")  # the hosts' environment allows them too
    for h in (node1, node2):  # the test's pause, in both checkouts' params.yaml
        request.addfinalizer(_restore(h.checkout / "params.yaml"))
        apply_overrides(h.checkout / "params.yaml", pause)
    env = {
        **node1.env,
        "ENN_SHARED": str(shared),
        "ENN_RDZV_PORT": str(testbed.bed.port(40)),
        "ENN_IFNAME": "eth0",
        "PREFECT_API_URL": prefect[0],
        "PREFECT_API_AUTH_STRING": prefect[1],
    }
    started = time.time()
    job = slurm.sbatch(node1, TRAIN, env=env)
    watch = Job([node1, node2], [], [], started=started)
    beats = _paused(watch)
    assert beats[1][0] is node2, "the rendezvous orders the nodes by name: node2 holds rank 1"
    say(f"SLURM job {job} running: {_fields(slurm.show(job))}")
    for h in testbed.hosts:
        say(f"during job {job}: {h.name} listens on {', '.join(map(str, h.listening()))}")
    old = {r: (h, b["pid"]) for r, (h, b) in beats.items()}

    node2.run("sh", "-c", "kill -9 -1")  # node2 dies: every process but its init
    down = _wait_for(lambda: "DOWN" in slurm.node_state(node2), "node2 DOWN", slurm, job)
    say(
        f"node2 killed: {node2.name} {slurm.node_state(node2)} after {down:.0f} s; "
        f"{_fields(slurm.show(job))}"
    )
    _wait_for(lambda: slurm.show(job).get("Restarts") == "1", "a requeue", slurm, job)
    for h in (node1, node2):  # an edit while the job waits (a comment: the run stays the same)
        with (h.checkout / "params.yaml").open("a") as f:
            f.write("# edited while job was requeued\n")
    slurm.revive(node2)  # its slurmd back: the job starts again on both nodes
    watch.started = time.time()
    beats = _paused(watch)
    for rank, (host, pid) in old.items():  # nothing of the first run is left to write
        assert host.run("kill", "-0", str(pid), check=False).returncode != 0, (rank, pid)
    say(f"after the requeue: {_fields(slurm.show(job))}")

    node1.run("scancel", "--batch", "--signal=USR2", job)  # the time-limit warning
    _wait_for(lambda: slurm.show(job).get("Restarts") == "2", "the script's requeue", slurm, job)
    done = slurm.wait(job, timeout=420)
    say(f"SLURM job {job} ended: {_fields(done)}")
    out = _log_of(node1, job)
    assert done["JobState"] == "COMPLETED", f"{done}\n{out}\n{slurm.logs()}"
    assert done["Restarts"] == "2" and done["NodeList"] == "node[1-2]", done
    # the warning's one line names the committed save; torchrun's traceback of the signal that
    # stopped it is in the job's log folder, not the output (flows.torchrun ends with 12)
    assert f"saved before the time limit (checkpoint {SAVED_AT} is committed" in out, out
    warned_run = out[out.index(f"job {job} attempt 1 ") :]
    assert "requeueing job" in warned_run and "Traceback" not in warned_run, out
    logs = shared / ".enn-jobs" / job / "logs"
    warned = [p.read_text() for p in logs.glob("torchrun-a1-*.log")]
    assert len(warned) == 2 and all("SIGUSR2" in t for t in warned), sorted(logs.iterdir())
    assert f"enn-train: job {job} done" in out, out
    # the requeued run names the edit of params.yaml since the job started (issue 54.6)
    assert f"params.yaml changed since job {job} started" in out, out
    # each node's lines carry srun's task number, which the script's first line maps (54.7)
    assert f"job {job} attempt 0 on node[1-2] " in out and "tasks 0: node1, 1: node2" in out
    lines = out.splitlines()
    assert any(x.startswith("0: ") for x in lines) and any(x.startswith("1: ") for x in lines)
    _flow_runs_on_the_server(out, prefect[0], request.getfixturevalue("postgres"), started, say)
    # the job secret: delivered by sbcast to each node's own disk, never on the shared folder;
    # a run that ended removed its copies (the run killed with node2 could not: at most one left)
    assert not [p for p in shared.rglob("*") if "secret" in p.name]
    tmp = Path(env.get("TMPDIR", "/tmp"))
    assert len(list(tmp.glob(f"enn-job-{job}-*.secret"))) <= 1
    resumed = _resumed(node1, started)
    assert resumed[-2:] == [f"step-{PAUSE_STEP:08d}", SAVED_AT], resumed
    assert not same_weights(published_model(node1), reference[0])  # bit-identical
    assert published_model(node2) is not None  # every node holds the model
    for stage in ("validate", "predict", "collapse-check", "export"):
        made = node1.checkout / "outputs" / stage
        assert made.is_dir() and made.stat().st_mtime > started, stage
    say(f"job {job}: resumed from {resumed}, bit-identical to one host")
    _one_parent_and_a_champion(node1, mlflow, job, say)


def _flow_runs_on_the_server(out: str, api: str, postgres, since: float, say) -> None:
    """The job said where its flow runs go, and each node's (step 1: `enn run --until
    prepare-checkpoint`) is on the tier's Prefect server, in its PostgreSQL, named with its host
    (issue 54.1: each `enn` had started a temporary API of its own)."""
    assert f"enn-train: Prefect API {api} (PREFECT_API_URL)" in out, out
    rows = postgres.sql(
        "select name || '|' || coalesce(state_type::text, '') from flow_run "
        f"where created >= to_timestamp({since}) order by name",
        "prefect",
    ).splitlines()
    names = [r.split("|")[0] for r in rows if "prepare-checkpoint" in r]
    assert sorted(n.split()[1] for n in names) == ["@node1", "@node2"], rows
    assert all(r.endswith("|COMPLETED") for r in rows if "prepare-checkpoint" in r), rows
    say(f"the job's flow runs on Prefect's server (PostgreSQL): {names}")


def _one_parent_and_a_champion(node1, mlflow: str, job: str, say) -> None:
    """The job's runs on the tracking server, read from node1 (the root namespace has no route
    to it): one parent, the stages that ran under it (stage-data and prepare-checkpoint are up
    to date in the bed's checkouts: step 1 records nothing), distributed-train once per run of
    the job, the model registered by this job's export and champion."""
    found = json.loads(node1.run("python", "-c", DUMP_JOB, mlflow, TRAIN_EXPERIMENT, job).stdout)
    runs = found["runs"]
    parents = [r for r in runs if r["kind"] == "pipeline"]
    assert len(parents) == 1, runs
    parent = parents[0]
    children = [r for r in runs if r["parent"] == parent["id"]]
    assert len(children) == len(runs) - 1, runs  # every run of the job is under it
    stages = {r["stage"] for r in children}
    assert stages >= {"distributed-train", "validate", "predict", "collapse-check", "export"}, runs
    trains = [r for r in children if r["stage"] == "distributed-train"]
    assert len(trains) == 3 and {r["host"] for r in trains} == {"node1"}, trains  # three runs
    assert parent["status"] == "FINISHED", parent
    export = next(r for r in children if r["stage"] == "export" and r["status"] == "FINISHED")
    champions = [m for m in found["models"] if m["champion"]]
    assert any(m["run"] in {export["id"], parent["id"]} for m in champions), found["models"]
    say(
        f"job {job} on MLflow: parent {parent['id']}, {len(children)} runs under it "
        f"({sorted(stages)}); champion: {[(m['name'], m['champion']) for m in champions]}"
    )


def _paused(watch: Job) -> dict:
    """Until rank 1 pauses at PAUSE_STEP (a resumed run's first step is `first_forward`)."""
    phases = ("step", "first_forward")
    return watch.wait_for_beat(
        lambda r, b: r == 0 or (b["phase"] in phases and b.get("step") == PAUSE_STEP), timeout=300
    )


def _wait_for(ok, what: str, slurm: Slurm, job: str, timeout: float = 180) -> float:
    t0 = time.time()
    while time.time() < t0 + timeout:
        if ok():
            return time.time() - t0
        time.sleep(0.5)
    raise AssertionError(f"job {job}: never {what}: {slurm.show(job)}\n{slurm.logs()}")


def _resumed(host, since: float) -> list[str]:
    """The checkpoints the job's runs resumed from (rank 0's records on `host`), in order."""
    found = []
    for p in (host.checkout / "work" / "runs").glob("*/distributed-train/events.jsonl"):
        if p.stat().st_mtime < since:
            continue
        for line in p.read_text().splitlines():
            e = json.loads(line)
            if e.get("name") == "resumed":
                found.append((e.get("time", 0), Path(e["fields"]["checkpoint"]).name))
    return [name for _, name in sorted(found)]


def _fields(info: dict[str, str]) -> str:
    keys = ("JobId", "JobState", "Reason", "Restarts", "NodeList", "BatchHost", "ExitCode")
    return " ".join(f"{k}={info.get(k)}" for k in keys)


def test_the_prediction_job_takes_the_model_on_every_node_and_equals_one_host(
    testbed, slurm, mlflow, say, request
):
    """deploy/slurm/predict.sbatch right after the training job, with `ENN_MODEL=champion`:
    every node takes the model the training job registered from the tracking server's registry
    by itself (each node's own outputs/distributed-train/model.pt holds the same bytes, not
    copied by hand), stages the input itself, and node1 assembles the parts; the output equals
    node1's prediction alone from the file the training job published to the shared folder
    (with collapse-check's calibration beside it), value for value and row for row."""
    node1, node2 = testbed.hosts[:2]
    model = testbed.shared / "enn-model" / "model.pt"  # where the training job published it
    assert (model.parent / "calibration.json").exists()
    mine = [(h.checkout / "outputs" / "distributed-train" / "model.pt") for h in (node1, node2)]
    assert all(p.exists() for p in mine), "run after the training job"
    assert mine[0].read_bytes() == mine[1].read_bytes()
    server = [f"tracking.uri={mlflow}", f"tracking.experiment={TRAIN_EXPERIMENT}"]
    for h in (node1, node2):  # the flow's collapse-check on the young model (LENIENT)
        request.addfinalizer(_restore(h.checkout / "prediction" / "params.yaml"))
        apply_overrides(h.checkout / "prediction" / "params.yaml", [*LENIENT, *server])
    env = {
        **node1.env,
        "ENN_SHARED": str(testbed.shared),
        "ENN_RDZV_PORT": str(testbed.bed.port(41)),
        "ENN_MODEL": "champion",  # models:/<the tier's model>@champion, from the registry
    }
    started = time.time()
    job = slurm.sbatch(node1, PREDICT, env=env)
    done = slurm.wait(job, timeout=400)
    say(f"SLURM job {job} ended: {_fields(done)}")
    log = node1.checkout / f"enn-predict-{job}.out"
    out = log.read_text(errors="replace") if log.exists() else ""
    assert done["JobState"] == "COMPLETED", f"{done}\n{out}\n{slurm.logs()}"
    assert "predict: this node's share is done" in out, out  # node2's task
    for h in (node1, node2):  # each node fetched the registry's champion itself
        fetched = [
            p.read_text().strip()
            for p in (h.checkout / "prediction").rglob("SOURCE")
            if p.stat().st_mtime > started
        ]
        assert fetched and all(s.endswith("@champion") for s in fetched), (h.name, fetched)
    assert not [p for p in testbed.shared.rglob("*") if "secret" in p.name]  # sbcast, not here
    assert not list(Path(env.get("TMPDIR", "/tmp")).glob(f"enn-job-{job}-*.secret"))  # removed
    across = _predictions(node1)
    assert not (node2.checkout / "prediction" / "outputs" / "predict").exists()
    node1.run("enn", "predict", "--pipeline", "prediction", "--set", f"predict.model={model}")
    alone = _predictions(node1)
    assert np.array_equal(across[0], alone[0]) and across[1] == alone[1]
    say(f"prediction job {job}: {len(alone[1])} rows on two nodes equal to node1's alone")


def _predictions(host) -> tuple[np.ndarray, list]:
    out = host.checkout / "prediction" / "outputs" / "predict"
    keys = pq.read_table(out / "predictions.parquet").select(["month", "daytype", "direction"])
    return np.load(out / "predictions.npy"), keys.to_pylist()


def test_a_job_array_shares_one_study_on_postgres(testbed, slurm, postgres, mlflow, say, request):
    """deploy/slurm/tune.sbatch as a job array of two tasks (`sbatch --array=0-1`), one per node
    (--exclusive), both in one Optuna study on the tier's PostgreSQL: the documented bound
    holds (n_trials to n_trials + tasks - 1 complete or pruned trials), trial numbers are
    unique and both nodes ran trials. One task is cancelled (`scancel <job>_<task>`) while its
    trial runs (issue 52.5): that trial is FAILED, recorded as interrupted, and its point runs
    once more, on the other node, to the end; no point is counted twice and the study
    finishes."""
    node1, node2 = testbed.hosts[:2]
    postgres.create_database("optuna_array")
    storage = postgres.url("optuna_array")
    params = [
        override("tune.study", ARRAY_STUDY),
        override("tune.storage", storage),
        override("tune.space", {"train.lr": {"low": 1e-4, "high": 0.03, "log": True}}),
        override("tune.n_trials", ARRAY_TRIALS),
        "tune.parallel=1",
        "tune.n_startup_trials=1",
        "tune.n_warmup_steps=1",
        "checkpoint.every_steps=0",
        f"tracking.uri={mlflow}",
        "tracking.experiment=tuning-array",
    ]
    for h in (node1, node2):
        request.addfinalizer(_restore(h.checkout / "params.yaml"))
        apply_overrides(h.checkout / "params.yaml", params)
    env = {**node1.env, **postgres.env}  # PGPASSWORD from the submitting environment
    submitted = time.time()
    job = slurm.sbatch(node1, "--array=0-1", TUNE, env=env)
    host, number = _cancel_a_running_trial(slurm, job, (node1, node2), submitted)
    tasks = _wait_array(slurm, job)
    say(f"tuning array {job}: " + "; ".join(_fields(t) for t in tasks))
    logs = "\n".join(
        p.read_text() for h in (node1, node2) for p in h.checkout.glob(f"enn-tune-{job}_*.out")
    )
    cancelled = next(t for t in tasks if t["NodeList"] == host.name)
    kept = next(t for t in tasks if t["NodeList"] != host.name)
    assert cancelled["JobState"] == "CANCELLED", f"{tasks}\n{logs}"
    assert kept["JobState"] == "COMPLETED", f"{tasks}\n{logs}"
    assert sorted(t["NodeList"] for t in tasks) == ["node1", "node2"], tasks
    trials = json.loads(
        node1.run("python", "-c", DUMP_TRIALS, storage, ARRAY_STUDY, env=env).stdout
    )
    ended = [t for t in trials if t["state"] in ("COMPLETE", "PRUNED")]
    assert ARRAY_TRIALS <= len(ended) <= ARRAY_TRIALS + 1, trials  # + tasks - 1
    assert len({t["number"] for t in trials}) == len(trials)
    assert not [t for t in trials if t["state"] in ("RUNNING", "WAITING")], trials
    points = [t["params"].get("train.lr") for t in trials if t["state"] == "COMPLETE"]
    assert len(points) == len(set(points)), trials  # no point counted twice (issue 52.5)
    # the cancelled trial: failed, recorded as interrupted; its point ran once more, elsewhere
    gone = next(t for t in trials if t["number"] == number)
    assert gone["state"] == "FAIL", trials
    end = json.loads((_trial_folder(host, number) / "end.json").read_text())
    assert end["state"] == "interrupted", end
    again = [t for t in ended if t["params"] == gone["params"]]
    assert len(again) == 1, trials
    assert _owner(again[0]) != host.name, trials
    # failed by its own task as it stopped, not left RUNNING for the other task's stale sweep
    # (tune.stale_after_s later): Prefect's SIGTERM is no exception Optuna tells FAIL for
    assert "missed its heartbeats" not in logs, logs
    hosts = {_owner(t) for t in trials if "enn.owner" in t["user_attrs"]}
    assert hosts == {node1.name, node2.name}, hosts
    say(
        f"tuning array {job}: task on {host.name} cancelled in trial {number}, its point ran "
        f"again as trial {again[0]['number']}; {len(ended)} trials complete or pruned"
    )


def _owner(trial: dict) -> str:
    return json.loads(trial["user_attrs"]["enn.owner"])["host"]


def _trial_folder(host, number: int) -> Path:
    return host.checkout / "work" / "tune" / ARRAY_STUDY / f"trial-{number}"


def _cancel_a_running_trial(slurm: Slurm, job: str, hosts, since: float, timeout: float = 300):
    """The first array task seen running a trial (its folder has a log and training's
    events, no end.json: mid-trial) is cancelled with `scancel <job>_<task>`; its host and
    trial number."""
    end = time.time() + timeout
    while time.time() < end:
        for host in hosts:
            for log in (host.checkout / "work" / "tune" / ARRAY_STUDY).glob("trial-*/trial.log"):
                folder = log.parent
                if log.stat().st_mtime < since or (folder / "end.json").exists():
                    continue
                if not events_file(folder).exists():  # not training yet
                    continue
                task = next(
                    parse_show(line)["ArrayTaskId"]
                    for line in slurm.scontrol(slurm.ctld, "show", "job", "-o", job).splitlines()
                    if parse_show(line).get("NodeList") == host.name
                )
                slurm.ctld.run("scancel", f"{job}_{task}")
                return host, int(folder.name.split("-")[1])
        time.sleep(0.5)
    raise AssertionError(f"array {job}: no task ran a trial in {timeout:.0f} s\n{slurm.logs()}")


def _wait_array(slurm: Slurm, job: str, timeout: float = 500) -> list[dict[str, str]]:
    end = time.time() + timeout
    tasks: list[dict[str, str]] = []
    while time.time() < end:
        out = slurm.scontrol(slurm.ctld, "show", "job", "-o", job)
        tasks = sorted(
            (parse_show(line) for line in out.splitlines() if line.strip()),
            key=lambda t: t.get("ArrayTaskId", ""),
        )
        if len(tasks) == 2 and all(t.get("JobState") in FINAL for t in tasks):
            return tasks
        time.sleep(1)
    raise AssertionError(f"array {job} did not end: {tasks}\n{slurm.logs()}")


def test_a_time_limit_too_short_for_the_warning_is_named_at_the_start(testbed, slurm, prefect):
    """A time limit that leaves no room for SLURM's warning (`--signal=B:USR2@90`) plus the
    save: the warning would come before training could save, and the job end TIMEOUT without a
    requeue (issue 54.6). The script says so in its first lines (one minute here), before it
    stages anything; the test then cancels the job, which says that no worker runs to save."""
    node1 = testbed.hosts[0]
    env = {
        **node1.env,
        "ENN_SHARED": str(testbed.shared),
        "ENN_RDZV_PORT": str(testbed.bed.port(42)),
        "PREFECT_API_URL": prefect[0],
        "PREFECT_API_AUTH_STRING": prefect[1],
    }
    job = slurm.sbatch(node1, "--time=1", TRAIN, env=env)
    said = "the time limit leaves"
    try:
        _wait_for(lambda: said in _log_of(node1, job), "the time-limit line", slurm, job, 60)
    finally:
        node1.run("scancel", job, check=False)
        slurm.wait(job, timeout=120)
        slurm.wait_idle(slurm.computes, timeout=120)  # its staging ended on both nodes
    line = next(x for x in _log_of(node1, job).splitlines() if said in x)
    assert "not more than the 90 s warning plus the 60 s save" in line, line
    assert "TIMEOUT without a requeue" in line and "--time" in line, line
    # cancelled while staging: no worker runs, and the script does not say they save (54.6)
    out = _log_of(node1, job)
    assert "no workers run now, nothing to save" in out and "the workers save" not in out, out
