"""One Optuna study shared by two real hosts (`tune.storage` on the tier's PostgreSQL, MLflow's
tracking server of the tier), run as docs/scale-out.md says: the same `enn tune` on node1 and
node2, each in its own checkout, with PGPASSWORD in the environment.

node2 runs the study's first trial alone; node1 joins and takes the queued point, which is
pruned against node2's trial (the pruner sees every host's trials); node2 joins again and,
paused mid-trial (a test fault), has every process SIGKILLed; node1 sees node2's trial miss
its heartbeats, fails it, runs it again and finishes the study. Then: trial numbers unique, no
point run by both hosts, n_trials to n_trials + 1 trials complete or pruned, one MLflow parent
with every host's trials as children tagged with their host, `enn tune --apply` on node2
writes the study's best value, the user of the storage URL is nowhere shown, and a process of
node1 that looks like node2's trial (its command line, its pid where the kernel gave it) was
not signalled."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from flows.params_file import apply_overrides
from tasks.tuning.study import override
from tests.fixtures.hosts import Host
from tests.fixtures.servers import http

pytestmark = pytest.mark.timeout(600)

STUDY = "shared"
EXPERIMENT = "tuning"
N_TRIALS = 4
# trial 0: a good rate (node2, alone); trial 1: a rate that barely moves the model, queued, taken
# by node1 and pruned at epoch 1 against trial 0, the only complete trial (n_startup_trials=1)
ENQUEUE = [{"train.lr": 0.02}, {"train.lr": 1e-6}]
SPACE = {"train.lr": {"low": 1e-6, "high": 0.03, "log": True}}
HEARTBEAT_S, STALE_AFTER_S = 2, 12
# node2's first trial of the second round pauses at step 2 (of 15): time to kill node2 mid-trial
# (shorter than the runtime's hang timeout, 60 s, so its own watchdog stays out of it)
PAUSE = ["fault.kind=delay", "fault.phase=step", "fault.step=2", "fault.seconds=45"]
DUMP = """
import json, sys, optuna
study = optuna.load_study(study_name=sys.argv[2], storage=sys.argv[1])
print(json.dumps([
    {"number": t.number, "state": t.state.name, "value": t.value, "params": t.params,
     "user_attrs": t.user_attrs, "steps": {str(k): v for k, v in t.intermediate_values.items()},
     "retry_of": t.system_attrs.get("failed_trial")}
    for t in study.get_trials()
]))
"""
# a process of node1 that node1's study did not start, with node2's trial's command line tail
# and, when that pid is free on node1, node2's trial's pid (ns_last_pid: the next pid - 1)
DECOY = (
    "echo {last} > /proc/sys/kernel/ns_last_pid; "
    "python -c 'import time; time.sleep(900)' -m tasks.tuning.trial {job} & wait"
)
DECOY_PROCESS = "^python -c import time; time.sleep.900"  # the python process, not its shell


def study_params(storage: str, mlflow: str) -> list[str]:
    """The tune: section (and tracking) every checkout's params.yaml gets: docs/scale-out.md."""
    return [
        override("tune.study", STUDY),
        override("tune.storage", storage),
        override("tune.space", SPACE),
        override("tune.n_trials", N_TRIALS),
        "tune.n_startup_trials=1",
        "tune.n_warmup_steps=1",
        "tune.parallel=1",
        override("tune.enqueue", ENQUEUE),
        f"tune.heartbeat_s={HEARTBEAT_S}",
        f"tune.stale_after_s={STALE_AFTER_S}",
        "checkpoint.every_steps=0",  # a checkpoint at each epoch's end only: short trials
        f"tracking.uri={mlflow}",
        f"tracking.experiment={EXPERIMENT}",
    ]


def sets(*overrides: str) -> list[str]:
    return [p for o in overrides for p in ("--set", o)]


def dump(host: Host, storage: str, env: dict[str, str]) -> list[dict]:
    """The study's trials as Optuna reads them from the storage, from inside `host`."""
    return json.loads(host.run("python", "-c", DUMP, storage, STUDY, env=env).stdout)


def owner(trial: dict) -> dict:
    return json.loads(trial["user_attrs"]["enn.owner"])


def wait_for(what, timeout: float, procs, logs: list[Path]):
    end = time.time() + timeout
    while time.time() < end:
        got = what()
        if got is not None:
            return got
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    tails = "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())
    raise AssertionError(f"timed out or a study exited:\n{tails}")


def test_two_hosts_share_one_study_and_one_finishes_after_the_other_dies(
    testbed, postgres, mlflow, say, tmp_path, request
):
    node1, node2 = testbed.hosts[:2]
    postgres.create_database("optuna")
    storage = postgres.url("optuna")  # postgresql://enn@node3:PORT/optuna: no password
    for h in (node1, node2):
        before = (h.checkout / "params.yaml").read_bytes()
        request.addfinalizer(lambda h=h, b=before: (h.checkout / "params.yaml").write_bytes(b))
        apply_overrides(h.checkout / "params.yaml", study_params(storage, mlflow))
    env = {h.name: {**h.env, **postgres.env} for h in (node1, node2)}
    folder = {h.name: h.checkout / "work" / "tune" / STUDY for h in (node1, node2)}
    t0 = time.time()

    # node2 alone: the study's first trial (the first queued point)
    node2.run("enn", "tune", "--set", "tune.n_trials=1", env=env[node2.name], timeout=400)
    say(f"shared study: node2 ran trial 0 alone in {time.time() - t0:.0f} s")

    # node1 joins and takes the queued point; node2 joins again once node1's trial 1 started,
    # its first trial paused at step 2 (its processes are killed meanwhile)
    logs = [tmp_path / "tune-node1.log", tmp_path / "tune-node2.log"]
    job1 = node1.popen("enn", "tune", log=logs[0], env=env[node1.name])
    wait_for(
        lambda: (folder["node1"] / "trial-1" / "trial.json").exists() or None, 300, [job1], logs
    )
    faults = testbed.shared / "faults-tune"
    pause = [f"fault.marker_dir={faults}", *PAUSE]
    job2 = node2.popen("enn", "tune", *sets(*pause), log=logs[1], env=env[node2.name])
    procs = [job1, job2]
    try:

        def victim() -> int | None:
            """node2's trial in its pause (the fault fired: its marker is there)."""
            if not faults.is_dir() or not any(faults.iterdir()):
                return None
            (running,) = [
                d for d in folder["node2"].glob("trial-*") if not (d / "end.json").exists()
            ]
            return int(running.name.removeprefix("trial-"))

        killed = wait_for(victim, 400, procs, logs)
        trials = dump(node1, storage, env[node1.name])
        assert owner(trials[killed])["host"] == node2.name
        job = testbed.bed.view / "work" / "tune" / STUDY / f"trial-{killed}" / "trial.json"
        trial_pid = min(node2.pids(f"tasks.tuning.trial .*trial-{killed}/trial.json"))
        decoy = node1.popen(
            "sh",
            "-c",
            DECOY.format(last=trial_pid - 1, job=job),
            log=tmp_path / "decoy.log",
            env=env[node1.name],
        )
        decoys = wait_for(lambda: node1.pids(DECOY_PROCESS) or None, 30, [decoy], logs)
        node2.run("sh", "-c", "kill -9 -1")  # every process of node2 but its init
        t_killed = time.time()
        assert job1.wait(timeout=400) == 0, logs[0].read_text()[-4000:]
        say(f"shared study: node1 finished {time.time() - t_killed:.0f} s after node2 died")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = logs[0].read_text()
    assert f"trial {killed} (on {node2.name}) missed its heartbeats" in text

    trials = dump(node1, storage, env[node1.name])
    states = {t["number"]: t["state"] for t in trials}
    ran = [t for t in trials if "enn.not_run" not in t["user_attrs"]]  # asked when full: not run
    hosts = {t["number"]: owner(t)["host"] for t in ran if "enn.owner" in t["user_attrs"]}
    say(f"shared study: trials {states}, hosts {hosts}")
    assert [t["number"] for t in trials] == list(range(len(trials)))  # Optuna numbered them
    ended = [t for t in trials if t["state"] in ("COMPLETE", "PRUNED")]
    assert N_TRIALS <= len(ended) <= N_TRIALS + 1, states  # n_trials + hosts - 1 at most
    first, queued = trials[0], trials[1]
    assert hosts[0] == node2.name and first["state"] == "COMPLETE"
    # node1's trial pruned against node2's: trial 0 was the only complete trial
    assert hosts[1] == node1.name and queued["state"] == "PRUNED", trials[:2]
    assert queued["params"] == {"train.lr": 1e-6} and queued["steps"]["1"] > first["steps"]["1"]
    assert states[killed] == "FAIL" and hosts[killed] == node2.name
    (again,) = [t for t in trials if t["retry_of"] == killed]
    assert again["params"] == trials[killed]["params"]  # the interrupted trial ran again
    assert again["state"] in ("COMPLETE", "PRUNED") and hosts[again["number"]] == node1.name
    run = [t for t in trials if t["number"] in hosts and t["retry_of"] is None]
    points = [t["params"]["train.lr"] for t in run]
    assert len(points) == len(set(points)), run  # no point run by two hosts
    assert {node1.name, node2.name} == set(hosts.values())

    # nothing of node1 was signalled that node1's study did not start
    assert set(decoys) <= set(node1.pids(DECOY_PROCESS)), "node1 signalled the decoy"
    same_pid = trial_pid in decoys
    say(f"decoy on node1 (pid {decoys}, node2's trial pid {trial_pid}): alive")
    for pid in decoys:
        node1.kill(pid)
    decoy.wait(timeout=30)

    # MLflow: one parent, every host's trials its children, tagged with their host
    api = f"{mlflow}/api/2.0/mlflow"
    exp = http(node1, f"{api}/experiments/get-by-name?experiment_name={EXPERIMENT}")
    runs = http(
        node1,
        f"{api}/runs/search",
        {"experiment_ids": [exp["experiment"]["experiment_id"]], "max_results": 200},
    )["runs"]
    tags = {r["info"]["run_id"]: {t["key"]: t["value"] for t in r["data"]["tags"]} for r in runs}
    parents = [r for r in runs if tags[r["info"]["run_id"]].get("enn.kind") == "tune"]
    assert len(parents) == 1 and parents[0]["info"]["status"] == "FINISHED", parents
    children = {
        int(tags[r["info"]["run_id"]]["enn.tune.trial"]): r
        for r in runs
        if tags[r["info"]["run_id"]].get("mlflow.parentRunId") == parents[0]["info"]["run_id"]
    }
    assert set(children) == set(hosts), (sorted(children), hosts)
    for number, child in children.items():
        assert tags[child["info"]["run_id"]]["enn.host"] == hosts[number]
    dead = tags[children[killed]["info"]["run_id"]]
    assert children[killed]["info"]["status"] == "KILLED" and dead["enn.tune.state"] == "stale"

    # --apply on any host (node2, whose processes all died): the value the best trial ran
    # (Optuna's sample to 4 significant digits), read from that trial's own config.yaml
    node2.run("enn", "tune", "--apply", env=env[node2.name])
    best = min((t for t in trials if t["state"] == "COMPLETE"), key=lambda t: t["value"])
    written = yaml.safe_load((node2.checkout / "params.yaml").read_text())["train"]["lr"]
    best_folder = folder[hosts[best["number"]]] / f"trial-{best['number']}"
    ran = next(best_folder.glob("work/runs/trial/*/config.yaml"))
    assert written == yaml.safe_load(ran.read_text())["train"]["lr"], ran
    assert written == pytest.approx(best["params"]["train.lr"], rel=1e-3)

    # the storage's user is redacted in what is shown (node1's console, a trial's config.yaml)
    user_at = f"{storage.split('//')[1].split('@')[0]}@{postgres.host.name}"
    assert user_at not in text
    shown = next(folder["node1"].glob("trial-*/work/runs/trial/*/config.yaml")).read_text()
    assert "postgresql://***@" in shown and user_at not in shown
    say(
        f"shared study: {len(ended)} trials complete or pruned of {N_TRIALS}, trial {killed} "
        f"failed on {node2.name} and ran again as trial {again['number']} on {node1.name}; "
        f"decoy had node2's pid: {same_pid}; {time.time() - t0:.0f} s in all"
    )
