"""The Prefect side across hosts, on servers with a real database: MLflow's tracking server
(the tier's `mlflow` fixture) and Prefect's server on node3, both on one PostgreSQL there
(artifacts proxied into the shared folder), a process work pool with one worker on node1 and
one on node2 (each in its own checkout at the same path), the training flow deployed to the
pool and triggered twice at once: one run on each host, both logging to the same MLflow
server, whose run list names the hosts. Every command is docs/scale-out.md's with the hosts'
names filled in. Both servers authenticate: an anonymous request is refused, the project's
clients log in with what their environment holds."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import pytest

from flows.params_file import apply_overrides
from tests.fixtures.hosts import Host
from tests.fixtures.servers import http

pytestmark = pytest.mark.timeout(600)

# docs/scale-out.md's deployment (Python: `prefect deploy` of 3.8.8 fails its worker check)
DEPLOY = (
    "from flows.training import training, POOL_JOB_VARIABLES as jv; "
    "training.from_source('{view}', 'flows/training.py:training')"
    ".to_deployment('pooled', work_pool_name='enn-pool', job_variables=jv).apply()"
)


def _restore(path):
    """A finalizer that puts `path` back as it is now (the other tests log locally)."""
    before = path.read_bytes()
    return lambda: path.write_bytes(before)


def test_two_hosts_run_pooled_flows_logging_to_servers_on_postgres(
    testbed, postgres, mlflow, prefect, say, tmp_path, request
):
    node1, node2, node3 = testbed.hosts
    bed, pg, mlflow_url = testbed.bed, postgres, mlflow
    api, auth = prefect  # the tier's Prefect server on node3, on PostgreSQL
    logs = tmp_path
    # an anonymous request is refused by both servers (issue 38.5)
    anonymous = http(node1, f"{api}/flow_runs/filter", {}, anonymous=True)
    assert anonymous.get("status") == 401, anonymous
    anonymous = http(node1, f"{mlflow_url}/api/2.0/mlflow/experiments/search", {}, anonymous=True)
    assert anonymous.get("status") == 401, anonymous
    wrong = http(node1, f"{api}/flow_runs/filter", {}, auth="enn:not-the-password")
    assert wrong.get("status") == 401, wrong
    for h in (node1, node2):  # params.yaml of each checkout: the shared tracking server
        request.addfinalizer(_restore(h.checkout / "params.yaml"))
        apply_overrides(h.checkout / "params.yaml", [f"tracking.uri={mlflow_url}"])
    client = {
        **node1.env,
        "PREFECT_API_URL": api,
        "PREFECT_API_AUTH_STRING": auth,
        "PREFECT_HOME": str(bed.view / "work" / "prefect"),
    }
    node1.run("prefect", "work-pool", "create", "enn-pool", "--type", "process", env=client)
    node1.run("python", "-c", DEPLOY.format(view=bed.view), env=client)
    workers = [
        h.popen(
            "prefect",
            "worker",
            "start",
            "--pool",
            "enn-pool",
            "--limit",
            "1",
            log=logs / f"worker-{h.name}.log",
            env={**client, "PREFECT_WORKER_QUERY_SECONDS": "2"},
        )
        for h in (node1, node2)
    ]
    try:
        run_ids = [
            re.search(
                r"UUID: ([0-9a-f-]{36})",
                node1.run(
                    "prefect",
                    "deployment",
                    "run",
                    "training/pooled",
                    "--param",
                    "until=distributed-train",
                    env=client,
                ).stdout,
            ).group(1)
            for _ in range(2)
        ]
        states = _wait_flow_runs(node1, api, run_ids, logs, client)
    finally:
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.pid, signal.SIGTERM)
            w.wait(timeout=30)
    assert states == {r: "COMPLETED" for r in run_ids}, _worker_logs(logs)

    exps = http(node1, f"{mlflow_url}/api/2.0/mlflow/experiments/search", {"max_results": 10})
    exp = next(e for e in exps["experiments"] if e["name"] == "enn")
    runs = http(
        node1,
        f"{mlflow_url}/api/2.0/mlflow/runs/search",
        {"experiment_ids": [exp["experiment_id"]], "max_results": 100},
    )["runs"]
    parents = {
        tags["prefect.flow_run_id"]: (r["info"]["run_name"], tags["enn.host"])
        for r in runs
        if (tags := {t["key"]: t["value"] for t in r["data"].get("tags", [])}).get("enn.kind")
        == "pipeline"
    }
    say(f"MLflow on PostgreSQL, parent runs: {sorted(parents.values())}")
    assert set(parents) == set(run_ids)
    hosts = sorted(host for _, host in parents.values())
    assert hosts == [node1.name, node2.name], parents  # one run on each host
    for name, host in parents.values():
        assert name.startswith("training #") and f" @{host} " in name, name
    # the run list as the UI asks for it from a browser at the server's address
    ui = http(
        node1,
        f"{mlflow_url}/ajax-api/2.0/mlflow/runs/search",
        {"experiment_ids": [exp["experiment_id"]], "max_results": 10},
        origin=mlflow_url,
    )
    assert len(ui.get("runs", [])) >= 4, ui  # a refused origin: {"error_code": ...}
    stages = [r for r in runs if r["info"]["run_name"] == "distributed-train"]
    assert len(stages) == 2 and {r["info"]["status"] for r in stages} == {"FINISHED"}
    # the servers kept their state in PostgreSQL, the artifacts in the shared folder
    # two parents and their distributed-train (stage-data and prepare-checkpoint were up to date)
    assert int(pg.sql("select count(*) from runs", "mlflow")) >= 4
    ids = ", ".join(f"'{r}'" for r in run_ids)  # the tier's server serves other tests' runs too
    done = f"select count(*) from flow_run where state_type = 'COMPLETED' and id in ({ids})"
    assert int(pg.sql(done, "prefect")) == 2
    assert list((testbed.shared / "mlflow-artifacts").rglob("config.yaml"))


def _wait_flow_runs(
    host: Host, api: str, run_ids: list[str], logs, env: dict[str, str], timeout: float = 480
):
    end = time.time() + timeout
    states: dict[str, str] = {}
    while time.time() < end:
        states = {r: http(host, f"{api}/flow_runs/{r}", env=env)["state"]["type"] for r in run_ids}
        if all(s in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for s in states.values()):
            return states
        time.sleep(3)
    raise AssertionError(f"flow runs still {states} after {timeout:.0f} s\n{_worker_logs(logs)}")


def _worker_logs(logs) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.glob("*.log")))
