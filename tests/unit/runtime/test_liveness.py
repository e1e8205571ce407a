"""Each node's liveness beat (issue 38.7): a node that goes silent is named by the others
(host, node rank, global ranks, endpoint) within the timeout, whatever its workers do; a node
that leaves on purpose (the job ended, a restart) is not."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time

import pytest

from enn_core.runtime.bound_store import tcp_store
from enn_core.runtime.launch import free_port
from enn_core.runtime.liveness import Liveness

KEY = b"k" * 32


@pytest.fixture
def endpoint():
    port = free_port()
    store = tcp_store("127.0.0.1", port, is_master=True, timeout=dt.timedelta(seconds=5))
    yield f"127.0.0.1:{port}"
    del store


def _node(endpoint: str, rank: int, said: list[str]) -> Liveness:
    return Liveness(
        endpoint,
        KEY,
        "job-live",
        0,
        rank,
        2,
        lambda node: f"{node * 2}-{node * 2 + 1}",
        timeout_s=1.0,
        every_s=0.1,
        on_silent=said.append,
    ).start()


def test_a_silent_node_is_named_by_the_others(endpoint):
    said: list[str] = []
    first, second = _node(endpoint, 0, said), _node(endpoint, 1, said)
    time.sleep(0.5)
    second._stop.set()  # killed: no last beat
    deadline = time.time() + 5
    while not said and time.time() < deadline:
        time.sleep(0.05)
    first.stop()
    assert len(said) == 1, said
    assert "(node rank 1, global ranks 2-3) went silent: no liveness beat for" in said[0]
    assert f"in the rendezvous store at {endpoint}" in said[0]


def test_a_node_that_leaves_on_purpose_is_not_silent(endpoint):
    said: list[str] = []
    first, second = _node(endpoint, 0, said), _node(endpoint, 1, said)
    time.sleep(0.5)
    second.stop()  # the job ended on that node
    time.sleep(2.0)
    first.stop()
    assert said == []


def test_a_store_that_stops_answering_is_named_and_never_holds_the_node(tmp_path):
    """A partition (here: the store's process stopped, so the kernel still accepts bytes and
    nothing answers): a store op then blocks far beyond the client's timeout. This node must
    still name the store within the timeout, and its last beat must not hold it."""
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import datetime as dt, time\n"
            "from enn_core.runtime.bound_store import tcp_store\n"
            f"s = tcp_store('127.0.0.1', {port}, is_master=True, "
            "timeout=dt.timedelta(seconds=60), multi_tenant=True, wait_for_workers=False)\n"
            "print('up', flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        said: list[str] = []
        node = _node(f"127.0.0.1:{port}", 0, said)
        time.sleep(0.5)
        assert said == []
        os.kill(server.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while not said and time.monotonic() - stopped < 10:
            time.sleep(0.05)
        assert len(said) == 1, said
        assert f"the rendezvous store at 127.0.0.1:{port} did not answer this node" in said[0]
        assert time.monotonic() - stopped < 5
        t0 = time.monotonic()
        node.stop()
        assert time.monotonic() - t0 < 5, "the last beat held the node"
    finally:
        server.kill()
        server.wait(10)


@pytest.mark.parametrize("where", ["another node's key", "a later round"])
def test_a_beat_copied_to_another_key_is_refused(endpoint, where):
    """Whoever reaches the store's port can copy a sealed beat (a `done` one, say) to another
    node's key or into a later round: the MAC binds both, so the copy is refused, never taken
    for that node's beat (which would hide a silent node)."""
    from enn_core.runtime.store_auth import UnauthenticatedWrite

    def node(rank: int, round_: int, nnodes: int = 3) -> Liveness:
        return Liveness(endpoint, KEY, "job-live", round_, rank, nnodes, str, timeout_s=1.0)

    leaving = node(1, 0)
    leaving._post(done=True)
    raw = leaving._store.get(leaving._key(1))
    reader = node(0, 1 if where == "a later round" else 0)
    target = 2 if where == "another node's key" else 1
    leaving._store.set(reader._key(target), raw)  # the copy
    with pytest.raises(UnauthenticatedWrite):
        reader._exchange()
