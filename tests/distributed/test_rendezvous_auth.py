"""A local user who reaches a one-node job's loopback rendezvous port cannot run code in it
(issue 38.1): the rendezvous state a process of another user could write is a pickle every
agent unpickled; now its HMAC with the job's key (made per launch when none is configured)
is checked first, and the job stops with one line naming the store."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest

from enn_core.runtime import secret
from enn_core.runtime.bound_store import tcp_store
from enn_core.runtime.launch import Rendezvous, free_port, launch
from tests.fixtures.distributed import forged_state, sleeper

pytestmark = pytest.mark.distributed


def started_job(run, started, outcome) -> threading.Thread:
    """`run` (a launch) in a thread, once its worker has written `started`."""
    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.time() + 60
    while not started.exists() and time.time() < deadline:
        time.sleep(0.1)
    assert started.exists(), outcome
    return thread


@pytest.mark.parametrize("configured", [False, True])
def test_a_local_process_writing_the_rendezvous_state_runs_nothing(
    tmp_path, monkeypatch, configured
):
    if configured:
        monkeypatch.setenv(secret.ENV, str(secret.make(tmp_path / "secret")))
    else:
        monkeypatch.delenv(secret.ENV, raising=False)
    endpoint, job = f"127.0.0.1:{free_port()}", "job-local"
    started, marker = tmp_path / "started", tmp_path / "ran"
    outcome: dict[str, BaseException | object] = {}

    def run() -> None:
        try:
            outcome["result"] = launch(
                sleeper,
                (str(started), 60.0),
                nprocs=2,  # one worker would start without torchrun: no rendezvous (below)
                run_dir=tmp_path / "run",
                hang_timeout_s=120,
                rdzv=Rendezvous(endpoint=endpoint, run_id=job),
            )
        except BaseException as e:  # noqa: BLE001  the test reads it
            outcome["error"] = e

    thread = started_job(run, started, outcome)
    host, port = endpoint.split(":")  # a plain client, as any local user can make one
    attacker = tcp_store(host, int(port), is_master=False, timeout=dt.timedelta(seconds=10))
    attacker.set(f"torch.rendezvous.{job}", forged_state(str(marker)))
    t0 = time.time()
    thread.join(60)
    assert not thread.is_alive()
    assert time.time() - t0 < 30  # within seconds, not when the sleeper ends (60 s)
    assert not marker.exists()
    error = str(outcome.get("error"))
    assert f"rendezvous store at {endpoint}" in error, outcome
    assert "unauthenticated write" in error


def test_a_one_worker_job_has_no_rendezvous_a_forged_state_runs_nothing(tmp_path, monkeypatch):
    """One worker on one node starts without torchrun: its endpoint is only its own store's
    port, where the rendezvous state a local process writes is read by no one."""
    monkeypatch.delenv(secret.ENV, raising=False)
    endpoint, job = f"127.0.0.1:{free_port()}", "job-one"
    started, marker = tmp_path / "started", tmp_path / "ran"
    outcome: dict[str, object] = {}

    def run() -> None:
        outcome["result"] = launch(
            sleeper,
            (str(started), 3.0),
            nprocs=1,
            run_dir=tmp_path / "run",
            hang_timeout_s=120,
            rdzv=Rendezvous(endpoint=endpoint, run_id=job),
        )

    thread = started_job(run, started, outcome)
    host, port = endpoint.split(":")
    try:
        attacker = tcp_store(host, int(port), is_master=False, timeout=dt.timedelta(seconds=5))
        attacker.set(f"torch.rendezvous.{job}", forged_state(str(marker)))
    except RuntimeError:  # the worker's store may be gone already (it is only needed at start)
        pass
    thread.join(60)
    assert not thread.is_alive() and outcome.get("result") == {0: 0}, outcome
    assert not marker.exists()


def test_an_unreachable_rendezvous_endpoint_is_one_line_naming_it(tmp_path, monkeypatch):
    """A node whose endpoint answers nothing (another machine's address that nothing serves)
    says so within runtime.rdzv_timeout_s, naming the endpoint."""
    monkeypatch.setenv(secret.ENV, str(secret.make(tmp_path / "secret")))
    endpoint = "192.0.2.1:29400"  # TEST-NET-1: no machine answers it
    t0 = time.time()
    with pytest.raises(Exception) as e:  # noqa: PT011  the launcher's class is not ours
        launch(
            sleeper,
            (str(tmp_path / "started"), 1.0),
            nprocs=1,
            run_dir=tmp_path / "run",
            hang_timeout_s=60,
            rdzv=Rendezvous(nnodes=2, endpoint=endpoint, run_id="job-far", timeout_s=5),
        )
    assert time.time() - t0 < 30
    line = str(e.value)
    assert f"the rendezvous endpoint {endpoint} did not answer within 5 s" in line, line
    assert "\n" not in line.strip()
    assert not (tmp_path / "started").exists()
