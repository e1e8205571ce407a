"""A shared study survives its worst member (two real hosts, the study on a PostgreSQL server
of its own on node3, tracking off):

- a RUNNING trial with no heartbeat and no owner (a client asked for it and died; Optuna's own
  sweep skips it) is failed by the hosts' sweep within the stale bound;
- PostgreSQL stopped while both hosts' trials train: each `enn tune` ends with one line naming
  the server (exit 10, no traceback) after its bounded retry; once the server is back the
  trials' states are consistent and a new `enn tune` finishes the study, nothing left RUNNING.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from flows.params_file import apply_overrides
from tasks.tuning.study import override
from tests.fixtures.postgres import USER, Postgres, bindir
from tests.multihost.test_tuning import DUMP, sets, wait_for

pytestmark = pytest.mark.timeout(900)

STUDY = "gone"
HEARTBEAT_S, STALE_AFTER_S = 2, 12
ORPHAN = """
import sys, optuna
study = optuna.create_study(study_name=sys.argv[2], storage=sys.argv[1], load_if_exists=True)
print(study.ask().number)  # RUNNING, then this client is gone: no heartbeat, no owner
"""


def dump(host, storage: str, env: dict[str, str]) -> list[dict]:
    """This study's trials as Optuna reads them from the storage, from inside `host`."""
    return json.loads(host.run("python", "-c", DUMP, storage, STUDY, env=env).stdout)


def pg_ctl(pg: Postgres, *args: str) -> None:
    opts = f"-p {pg.port} -k {pg.data} -c listen_addresses={pg.host.addr}"
    log = str(pg.data.parent / "server.log")
    cmd = [str(bindir() / "pg_ctl"), "-D", str(pg.data), "-o", opts, "-l", log, "-w", *args]
    pg.host.run("runuser", "-u", "postgres", "--", *cmd)


def test_an_orphan_is_failed_and_a_stopped_server_is_one_line_per_host(
    testbed, say, tmp_path, request
):
    node1, node2 = testbed.hosts[:2]
    pg = Postgres.start(testbed.hosts[2], testbed.bed.base / "postgres-tune", testbed.bed.port(6))
    request.addfinalizer(pg.stop)
    pg.create_database(STUDY)
    storage = pg.url(STUDY)
    for h in (node1, node2):
        before = (h.checkout / "params.yaml").read_bytes()
        request.addfinalizer(lambda h=h, b=before: (h.checkout / "params.yaml").write_bytes(b))
        apply_overrides(
            h.checkout / "params.yaml",
            [
                override("tune.study", STUDY),
                override("tune.storage", storage),
                override("tune.space", {"train.lr": {"low": 1e-4, "high": 0.03, "log": True}}),
                "tune.n_trials=20",
                "tune.parallel=1",
                "tune.pruner=none",
                f"tune.heartbeat_s={HEARTBEAT_S}",
                f"tune.stale_after_s={STALE_AFTER_S}",
                "checkpoint.every_steps=0",
                "tracking.enabled=false",
            ],
        )
    env = {h.name: {**h.env, **pg.env} for h in (node1, node2)}
    folder = {h.name: h.checkout / "work" / "tune" / STUDY for h in (node1, node2)}
    orphan = int(node1.run("python", "-c", ORPHAN, storage, STUDY, env=env["node1"]).stdout)

    logs = [tmp_path / "tune-node1.log", tmp_path / "tune-node2.log"]
    long = sets("train.epochs=200")  # trials that train until the server goes
    procs = [
        h.popen("enn", "tune", *long, log=log, env=env[h.name])
        for h, log in zip((node1, node2), logs, strict=True)
    ]
    try:

        def running(name: str) -> Path | None:
            found = [d for d in folder[name].glob("trial-*") if not (d / "end.json").exists()]
            return found[0] if found else None

        wait_for(lambda: running("node1"), 300, procs, logs)
        t_first = time.time()  # node1's study runs its trials (and sweeps) from here

        def orphan_failed() -> bool | None:
            trials = dump(node1, storage, env["node1"])
            return trials[orphan]["state"] == "FAIL" or None

        wait_for(orphan_failed, STALE_AFTER_S + 60, procs, logs)
        took = time.time() - t_first
        say(f"orphan trial {orphan} failed {took:.0f} s after node1's first trial started")
        assert took <= STALE_AFTER_S + 4 * HEARTBEAT_S + 10  # the bound, a sweep, the dump
        wait_for(lambda: running("node2"), 300, procs, logs)
        sizes = [log.stat().st_size for log in logs]
        pg_ctl(pg, "-m", "fast", "stop")  # the storage goes while both hosts' trials train
        t_stop = time.time()
        codes = [p.wait(timeout=STALE_AFTER_S + 120) for p in procs]
        say(f"both hosts ended {time.time() - t_stop:.0f} s after PostgreSQL stopped")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for log, size, code in zip(logs, sizes, codes, strict=True):
        text = log.read_text()
        after = [line for line in text[size:].splitlines() if line.strip()]
        assert code == 10 and "Traceback" not in text, text[-3000:]
        assert len(after) == 1, after
        assert after[0].startswith("error: ") and "cannot be reached" in after[0], after
        assert (
            f"postgresql://***@{pg.host.name}:{pg.port}/{STUDY}" in after[0]
            and f"{USER}@" not in after[0]
        )

    pg_ctl(pg, "start")  # the server back: the trials' states are consistent
    trials = dump(node1, storage, env["node1"])
    states = {t["number"]: t["state"] for t in trials}
    for t in trials:
        if t["state"] == "RUNNING":  # a host's trial whose tell never reached the server
            assert json.loads(t["user_attrs"]["enn.owner"])["host"] in ("node1", "node2"), t
    done = sum(s in ("COMPLETE", "PRUNED") for s in states.values())
    node1.run(
        "enn",
        "tune",
        *sets("train.epochs=2", f"tune.n_trials={done + 1}"),
        env=env["node1"],
        timeout=400,
    )
    after = {t["number"]: t["state"] for t in dump(node1, storage, env["node1"])}
    say(f"stopped-server study: {states} -> {after}")
    assert "RUNNING" not in after.values(), after
    assert sum(s in ("COMPLETE", "PRUNED") for s in after.values()) >= done + 1
