"""The rendezvous store's values are authenticated with the job secret (issue 38.1): a value
nobody of the job wrote is never unpickled nor used; the secret file is checked."""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
from types import SimpleNamespace

import pytest

from enn_core.errors import ConfigError
from enn_core.runtime import secret
from enn_core.runtime.launch import free_port
from enn_core.runtime.store_auth import MacStore, RendezvousNodesDiffer, UnauthenticatedWrite
from enn_core.runtime.stores import (
    Waiting,
    agree_on_nodes,
    job_key,
    launch_nonce,
    rendezvous_backend,
    tcp_store,
)
from tests.fixtures.distributed import forged_state


@pytest.fixture
def store():
    return tcp_store("127.0.0.1", free_port(), is_master=True, timeout=dt.timedelta(seconds=5))


def test_state_round_trips_and_a_forged_pickle_is_refused_unread(store, tmp_path):
    backend = rendezvous_backend(store, "job-a", b"k" * 32, "127.0.0.1:1")
    assert backend.get_state() is None
    state, token, ok = backend.set_state(b"the state")
    assert (state, ok) == (b"the state", True)
    assert backend.get_state() == (b"the state", token)
    marker = tmp_path / "ran"
    store.set("torch.rendezvous.job-a", forged_state(str(marker)))  # what an attacker writes
    with pytest.raises(UnauthenticatedWrite, match=r"store at 127\.0\.0\.1:1 .*unauthenticated"):
        backend.get_state()
    with pytest.raises(UnauthenticatedWrite):
        backend.set_state(b"next", token)  # compare_set fails and returns the forged value
    assert not marker.exists()
    # a state sealed with another secret (another job, a node given the wrong file) is refused
    other = rendezvous_backend(store, "job-a", b"x" * 32, "127.0.0.1:1")
    with pytest.raises(UnauthenticatedWrite):
        other.get_state()


def test_a_state_sealed_by_an_earlier_launch_of_the_same_job_is_refused(store):
    """Issue 52.7: the MAC binds the launch (a nonce the store's host draws), not only the run
    id: an earlier job's sealed state, replayed into a later job with the same id and secret,
    fails; the nodes of one launch agree on its nonce."""
    key, where = b"k" * 32, "127.0.0.1:1"
    first = launch_nonce(store, key, "job-r", True, where)
    assert launch_nonce(store, key, "job-r", False, where) == first  # another node
    earlier = rendezvous_backend(store, "job-r", key, where, first)
    earlier.set_state(b"the first job's state")
    agree_on_nodes(store, key, _params("job-r", 2), first)
    recorded = {k: store.get(k) for k in ("torch.rendezvous.job-r", "enn/job-r/nodes")}
    later_store = tcp_store("127.0.0.1", free_port(), is_master=True, timeout=dt.timedelta(5))
    second = launch_nonce(later_store, key, "job-r", True, where)
    assert second != first
    for k, v in recorded.items():  # what an attacker who kept the first job's values writes
        later_store.set(k, v)
    later = rendezvous_backend(later_store, "job-r", key, where, second)
    with pytest.raises(UnauthenticatedWrite, match="the rendezvous state of job job-r"):
        later.get_state()
    with pytest.raises(UnauthenticatedWrite, match="the node count"):
        agree_on_nodes(later_store, key, _params("job-r", 2), second)
    later_store.set("enn/job-r/launch", b"forged")
    with pytest.raises(UnauthenticatedWrite, match="the launch"):
        launch_nonce(later_store, key, "job-r", False, where)


def test_the_agents_store_seals_what_it_sets_and_refuses_what_it_did_not(store):
    mac = MacStore(store, b"k" * 32, "job-a/0", "127.0.0.1:1")
    mac.set("MASTER_ADDR", b"node1")
    mac.multi_set(["a", "b"], ["1", "2"])
    assert mac.get("MASTER_ADDR") == b"node1"
    assert mac.multi_get(["a", "b"]) == [b"1", b"2"]
    assert mac.add("count", 2) == 2
    store.set("MASTER_ADDR", b"attacker.example")
    with pytest.raises(UnauthenticatedWrite, match="store key MASTER_ADDR"):
        mac.get("MASTER_ADDR")
    replayed = MacStore(store, b"k" * 32, "job-a/1", "127.0.0.1:1")  # another round
    store.set("a", store.get("b"))
    with pytest.raises(UnauthenticatedWrite):
        replayed.get("a")


def test_secret_file_checks(tmp_path, monkeypatch):
    monkeypatch.delenv(secret.ENV, raising=False)
    assert secret.load() is None
    path = secret.make(tmp_path / "s")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    monkeypatch.setenv(secret.ENV, str(path))
    assert len(secret.load()) == 64
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others .*chmod 600"):
        secret.load()
    path.chmod(0o600)
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "elsewhere" / "link"
    link.symlink_to(path)  # out of its own folder (a link inside it: test_secret_volume.py)
    monkeypatch.setenv(secret.ENV, str(link))
    with pytest.raises(ConfigError, match="link leading out of its folder"):
        secret.load()
    monkeypatch.setenv(secret.ENV, str(tmp_path))
    with pytest.raises(ConfigError, match="not a regular file"):
        secret.load()
    short = tmp_path / "short"
    short.write_text("abc")
    short.chmod(0o600)
    monkeypatch.setenv(secret.ENV, str(short))
    with pytest.raises(ConfigError, match="holds 3 bytes"):
        secret.load()


def test_launch_env_makes_one_per_work_dir_on_one_node_and_refuses_several_without(
    tmp_path, monkeypatch
):
    monkeypatch.delenv(secret.ENV, raising=False)
    with pytest.raises(ConfigError, match=f"nnodes=2 needs a job secret in {secret.ENV}"):
        secret.launch_env(tmp_path, 2)
    with pytest.raises(ConfigError, match="needs a job secret"):
        job_key(2)
    assert len(job_key(1)) == 32  # one node: a fresh key in memory
    env = secret.launch_env(tmp_path, 1)
    assert env == {secret.ENV: str(tmp_path / secret.FILE_NAME)}
    assert secret.launch_env(tmp_path, 1) == env  # reused: kept parts stay valid
    assert (tmp_path / secret.FILE_NAME).stat().st_mode & 0o077 == 0
    monkeypatch.setenv(secret.ENV, env[secret.ENV])
    assert secret.launch_env(tmp_path, 4) == {}  # inherited by the child
    assert os.environ[secret.ENV] == env[secret.ENV]


def _params(run_id: str, nodes: int, endpoint: str = "127.0.0.1:1") -> SimpleNamespace:
    return SimpleNamespace(run_id=run_id, min_nodes=nodes, max_nodes=nodes, endpoint=endpoint)


def test_nodes_that_count_the_job_differently_are_named(store):
    agree_on_nodes(store, b"k" * 32, _params("job-n", 2))
    agree_on_nodes(store, b"k" * 32, _params("job-n", 2))  # a restart, or the second node
    with pytest.raises(RendezvousNodesDiffer, match=r"disagree on runtime.nnodes: .* said 2, .*3"):
        agree_on_nodes(store, b"k" * 32, _params("job-n", 3))


def test_a_node_waiting_in_the_rendezvous_says_whom_it_waits_for(caplog):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc as Node

    node = Node("node1", 123, 0)
    state = SimpleNamespace(round=0, participants={node: 0}, wait_list=set())
    handler = SimpleNamespace(_state_holder=SimpleNamespace(state=state))
    waiting = Waiting(handler, _params("job-w", 3, "node1:29400"), 0.05)
    thread = threading.Thread(target=waiting.run)
    with caplog.at_level(logging.WARNING, logger="enn.launch"):
        thread.start()
        time.sleep(0.3)
        waiting.stop.set()
        thread.join(5)
    assert (
        "rendezvous job-w at node1:29400: still waiting for 2 more node(s) of 3; seen: node1"
        in caplog.text
    )
