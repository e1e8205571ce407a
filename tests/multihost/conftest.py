"""The multi-host tier: three hosts made on this machine (tests/fixtures/hosts.py) and one
PostgreSQL on the third (tests/fixtures/postgres.py), once per test session.

- `testbed`: node1, node2 and node3, each with its own checkout of a tiny project (at the same
  path on every host: `TestBed.view`) on which the training flow ran once (staged data, model,
  calibration, export: what `dvc pull` gives each machine of a cluster), and one shared folder
  (`TestBed.shared`);
- `postgres`: PostgreSQL listening on node3's address only;
- `mlflow`: MLflow's tracking server on node3, its runs in that PostgreSQL, artifacts in the
  shared folder (its URL, as the hosts name it);
- `prefect`: Prefect's server on node3, its flow runs in that PostgreSQL, with an API auth
  string (its API's URL and the auth string);
- `reference`: the training job on node1 alone with two workers (its weights and seconds), which
  every two-node job of the template must equal bit for bit (test_training, test_slurm).

Where namespaces or PostgreSQL cannot be made (not root, binaries missing), the tests skip with
one line saying why and how to run them; under CI=true they fail instead (scripts/test.sh's
multi-host tier must not skip on CI). The log shows each host's name and address and the
PostgreSQL version.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import pytest

from tests.fixtures.hosts import TestBed, missing_capability
from tests.fixtures.multihost import STAGE, TEMPLATE, Cluster, give_job_secret, published_model
from tests.fixtures.postgres import Postgres
from tests.fixtures.postgres import missing as postgres_missing
from tests.fixtures.project import contained_env, make_project
from tests.fixtures.servers import mlflow_server, prefect_server

NAMES = ["node1", "node2", "node3"]


def unavailable(why: str | None) -> None:
    """Skip with the reason, or fail under CI=true (the tier must run there)."""
    if why is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"multi-host tests must run on CI, but: {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def say(request) -> Iterator:
    """Write a line into the tier's log (the terminal), whatever pytest captures."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def write(line: str) -> None:
        if reporter is None:
            return
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            reporter.write_line(f"[multihost] {line}")

    yield write


@pytest.fixture(scope="session")
def testbed(say) -> Iterator[Cluster]:
    unavailable(missing_capability())
    bed = TestBed.create()
    try:
        project = make_project(bed.view, None)
        project.set_params(TEMPLATE)
        # the seven stages (what every machine gets by `dvc pull`), long enough for a model
        # that passes collapse-check; the training tests then train 3 epochs from the same init
        project.run("enn", "run", "--set", "train.epochs=12")
        project.set_params(TEMPLATE)
        hosts = bed.start(NAMES, env=contained_env(bed.view))
        give_job_secret(hosts)
        for h in hosts:
            say(f"host {h.name} at {h.addr} (namespace {h.netns}), checkout {h.view}")
        say(f"shared folder {bed.shared}")
        yield Cluster(bed, hosts)
    finally:
        bed.close()


@pytest.fixture(scope="session")
def postgres(testbed: Cluster, say) -> Iterator[Postgres]:
    unavailable(postgres_missing())
    pg = Postgres.start(testbed.hosts[2], testbed.bed.base / "postgres", testbed.bed.port(5))
    say(f"PostgreSQL on {pg.host.name}:{pg.port}: {pg.version}")
    try:
        yield pg
    finally:
        pg.stop()


@pytest.fixture(scope="session")
def mlflow(testbed: Cluster, postgres: Postgres, say, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("mlflow-server") / "mlflow.log"
    with mlflow_server(testbed, postgres, log) as url:
        say(f"MLflow's tracking server at {url}, on PostgreSQL")
        yield url


@pytest.fixture(scope="session")
def prefect(
    testbed: Cluster, postgres: Postgres, say, tmp_path_factory
) -> Iterator[tuple[str, str]]:
    log = tmp_path_factory.mktemp("prefect-server") / "prefect.log"
    with prefect_server(testbed, postgres, log) as (api, auth):
        say(f"Prefect's server at {api}, on PostgreSQL")
        yield api, auth


@pytest.fixture(scope="session")
def reference(testbed: Cluster, say):
    """The job on node1 alone with the same world size (two workers): its weights and time."""
    node1 = testbed.hosts[0]
    t0 = time.time()
    node1.run(
        "enn",
        STAGE,
        "--set",
        "runtime.world_size=2",
        "--set",
        f"checkpoint.dir={testbed.shared / 'ckpt-one-host'}",
    )
    wall = time.time() - t0
    say(f"one host ({node1.name}), world size 2: {wall:.1f} s")
    return published_model(node1), wall
