"""Each node's liveness beat (issue 38.7): a node that goes silent is named by the others
(host, node rank, global ranks, endpoint) within the timeout, whatever its workers do; a node
that leaves on purpose (the job ended, a restart) is not. The workers a node then stops are
its agent's children started after the rendezvous, by pid and start time (issue 53.0), never
picked by their command line."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from enn_core.runtime.bound_store import tcp_store
from enn_core.runtime.launch import free_port
from enn_core.runtime.liveness import Liveness, Workers, stopped_workers

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


def _child(*argv: str) -> subprocess.Popen:
    """A child of this process that waits on its standard input (ends when it closes)."""
    return subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE)


def _alive(proc: subprocess.Popen) -> bool:
    time.sleep(0.2)
    return proc.poll() is None


def _end(*procs: subprocess.Popen) -> None:
    for proc in procs:
        proc.kill()
        proc.wait(10)


def test_a_silent_peer_stops_the_workers_started_after_the_rendezvous(endpoint, tmp_path):
    """The agent's own beat (no `on_silent`): a peer goes silent, and the child this process
    started after the rendezvous (the enn launcher's worker: `-m enn_core.runtime.entry`) is
    killed, while one it had before (a server of its own) lives on; the line is kept for the
    agent's record of the attempt."""
    server = _child("-c", "import sys; sys.stdin.read()")
    said: list[str] = []
    agent = Liveness(endpoint, KEY, "job-live", 0, 0, 2, str, timeout_s=1.0, every_s=0.1)
    job = tmp_path / "job.json"  # a worker that sleeps until it is killed
    job.write_text(json.dumps({"entry": "time:sleep", "args": [60], "run_dir": str(tmp_path)}))
    worker = _child("-m", "enn_core.runtime.entry", str(job))
    peer = _node(endpoint, 1, said)
    try:
        agent.start()
        time.sleep(0.5)
        peer._stop.set()  # killed: no last beat
        assert worker.wait(timeout=10) == -signal.SIGKILL
        assert _alive(server), "a child started before the rendezvous was killed"
        # what enn's torchrun records as the attempt's end (`peer_silent`), not a crash
        assert "(node rank 1, global ranks 1) went silent" in (stopped_workers() or "")
    finally:
        agent.stop()
        _end(server, worker)


def test_workers_are_the_children_that_appeared_after_the_rendezvous():
    before = _child("-c", "import sys; sys.stdin.read()")
    workers = Workers()
    after = _child("-c", "import sys; sys.stdin.read()")
    try:
        workers.record()
        assert set(workers.seen) == {after.pid}
        assert workers.stop() == [after.pid]
        assert after.wait(timeout=10) == -signal.SIGKILL
        assert _alive(before)
    finally:
        _end(before, after)


def test_a_reused_pid_with_another_start_time_is_not_killed():
    """A worker recorded by pid and start time; the process now at that pid (not a child of
    this one: the worker ended and its pid went elsewhere) started at another time, and is not
    signalled. The same process recorded with its own start time is."""
    wait = "import sys; sys.stdin.read()"
    middle = _child(
        "-c",
        "import subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', {wait!r}], stdin=subprocess.PIPE)\n"
        f"{wait}\n",
    )
    workers = Workers()  # `middle` is a child from before the rendezvous
    try:
        other = psutil.Process(_grandchild(middle))
        started = other.create_time()
        workers.seen[other.pid] = started - 5.0  # the worker that had this pid
        assert workers.stop() == []
        assert not _ended(other, 0.5)
        workers.seen[other.pid] = started
        assert workers.stop() == [other.pid]
        assert _ended(other, 10)
        assert _alive(middle)
    finally:
        _end(middle)


def _ended(proc: psutil.Process, within_s: float) -> bool:
    """Whether `proc` ends (gone, or a zombie its parent has not reaped) within `within_s`."""
    deadline = time.time() + within_s
    while True:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.time() > deadline:
            return False
        time.sleep(0.05)


def _grandchild(middle: subprocess.Popen) -> int:
    deadline = time.time() + 10
    while time.time() < deadline:
        children = psutil.Process(middle.pid).children()
        if children:
            return children[0].pid
        time.sleep(0.05)
    raise AssertionError("the grandchild never started")


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
