"""Each node's liveness beat in the rendezvous store: a silent node is named by the others.

A node that goes silent (a network partition, a kill) leaves its peers waiting inside a
collective: each node's own watchdog then sees only its own ranks stalled and names them.
Here every node's agent (the rendezvous handler, enn_core.runtime.stores; both launchers)
posts a beat to the rendezvous store every `every_s` seconds, independent of training
progress, sealed with the job secret (enn_core.runtime.store_auth); each node reads the
others' beats. A node whose beat has not advanced for `timeout_s` (runtime.hang_timeout_s),
or a store this node cannot reach for as long, is one line naming the silent node, its
global ranks and the endpoint; then this node's workers are stopped, so the agent ends the
attempt (and restarts it when restarts are left) instead of waiting for the collective's
timeout. The workers are the agent's children that appeared after the rendezvous, each
recorded by pid and start time when it appears (`Workers`): whatever their command line (the
enn launcher's `-m enn_core.runtime.entry`, a recipe's `-m flows.worker`), never a process
the agent had before, never one that took a dead worker's pid. A node cut off from the store
itself ends its agent's process when the store stays silent a while longer: torch's agent,
blocked in a store call, would never end.

Every store call runs in a thread of its own: on a partitioned link a TCPStore call blocks far
beyond the client's timeout, and this thread must keep its own clock.

    beat = Liveness(endpoint, key, run_id, round_, node_rank, nnodes, ranks_of, timeout_s)
    beat.start(); ...; beat.stop()   # posts a last beat saying this node left on purpose
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

log = logging.getLogger("enn.launch")
EVERY_S = 2.0
CUT_OFF_GRACE_S = 30.0  # after naming an unreachable store: then the agent's process ends
START_TOLERANCE_S = 0.01  # psutil's create_time of one process, read twice, agrees to this
_when_cut_off: list[Callable[[str], None]] = []
_newest: list[Liveness] = []  # this agent's beat of its newest round


def when_cut_off(hook: Callable[[str], None]) -> None:
    """`hook(line)` runs just before a node cut off from its store ends its agent's process
    (enn_core.runtime.torchrun records how the job ended)."""
    _when_cut_off.append(hook)


def stopped_workers() -> str | None:
    """The line for which this agent's beat of its newest round stopped the workers, or None:
    a failed attempt is then this node's doing, not a crash (enn_core.runtime.torchrun)."""
    return _newest[-1].stopped if _newest else None


class Liveness:
    """The beat thread of one node for one rendezvous round (module docstring)."""

    def __init__(  # noqa: PLR0913  what one round of the job is
        self,
        endpoint: str,
        key: bytes,
        run_id: str,
        round_: int,
        node_rank: int,
        nnodes: int,
        ranks_of: Callable[[int], str],
        timeout_s: float,
        every_s: float = EVERY_S,
        on_silent: Callable[[str], None] | None = None,
    ) -> None:
        self.endpoint, self.key, self.run_id, self.round = endpoint, key, run_id, round_
        self.node_rank, self.nnodes, self.ranks_of = node_rank, nnodes, ranks_of
        self.timeout_s, self.every_s = timeout_s, every_s
        # the agent's own beat: it stops the agent's workers and may end the agent's process
        self.in_agent = on_silent is None
        self.workers = Workers() if self.in_agent else None  # before the workers start
        self.on_silent = on_silent or self._stop_workers
        self.stopped: str | None = None  # why this beat stopped the workers
        self._stop = threading.Event()
        self._store: Any = None
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="enn-liveness", daemon=True)
        self._answers: queue.Queue[tuple[float, Any]] = queue.Queue()
        self._asking = False  # an exchange in flight

    def _key(self, node: int) -> str:
        return f"enn/{self.run_id}/round{self.round}/alive/{node}"

    def _context(self, node: int) -> str:
        """What a beat's MAC binds besides the job: its round and node, so that a beat copied
        to another node's key or into a later round (a `done` one, say) is refused."""
        return f"{self.run_id}/{self._key(node)}"

    def start(self) -> Liveness:
        if self.in_agent:
            _newest[:] = [self]
        self._thread.start()
        return self

    def stop(self) -> None:
        """This node leaves the round on purpose (the job ended, or a restart): a last beat
        says so, and the others do not take its silence for a failure. A store that does not
        answer holds this call at most a few beats' time, never the agent's exit."""
        self._stop.set()
        self._thread.join(timeout=self.every_s * 3)
        last = threading.Thread(
            target=self._post, kwargs={"done": True}, name="enn-last-beat", daemon=True
        )
        last.start()
        last.join(timeout=max(2.0, self.every_s * 2))

    def _post(self, *, done: bool = False) -> None:
        from enn_core.runtime.bound_store import tcp_store
        from enn_core.runtime.store_auth import seal

        host, _, port = self.endpoint.rpartition(":")
        beat = {"seq": self._seq + 1, "host": socket.gethostname(), "done": done}
        with contextlib.suppress(RuntimeError, OSError, ValueError):
            if self._store is None:
                self._store = tcp_store(
                    host,
                    int(port),
                    is_master=False,
                    timeout=_dt.timedelta(seconds=max(2.0, self.every_s * 2)),
                    multi_tenant=True,
                )
            beat_bytes = json.dumps(beat).encode()
            value = seal(self.key, "a beat", self._context(self.node_rank), beat_bytes)
            self._store.set(self._key(self.node_rank), value)
            self._seq += 1

    def _exchange(self) -> dict[int, tuple[int, str, bool]]:
        """Post this node's beat and read the others' ({node: (seq, host, done)}); raises when
        the store does not answer or a beat is not one (sealed, yet malformed). A store op on
        a partitioned link can block far beyond the store's timeout (measured: over 80 s on a
        4 s client), so `_run` calls this in a thread."""
        from enn_core.runtime.store_auth import unseal

        self._post()
        if self._store is None:
            raise OSError("no store")
        beats: dict[int, tuple[int, str, bool]] = {}
        for node in range(self.nnodes):
            key = self._key(node)
            if node == self.node_rank or not self._store.check([key]):
                continue
            raw = self._store.get(key)
            got = json.loads(unseal(self.key, "a beat", self._context(node), raw, self.endpoint))
            beats[node] = (int(got["seq"]), str(got["host"])[:100], bool(got.get("done")))
        return beats

    def _ask(self) -> None:
        """One exchange in a thread of its own, unless one is still in flight (a hung one is
        not piled on); its answer (when it came, the beats or the exception) is queued."""
        if self._asking:
            return
        self._asking = True

        def exchange() -> None:
            try:
                self._answers.put((time.monotonic(), self._exchange()))
            except Exception as e:  # noqa: BLE001  the loops below decide what each means
                self._answers.put((time.monotonic(), e))

        threading.Thread(target=exchange, name="enn-beat", daemon=True).start()

    def _answered(self) -> list[tuple[float, Any]]:
        out = []
        while not self._answers.empty():
            out.append(self._answers.get_nowait())
            self._asking = False
        return out

    def _run(self) -> None:
        from enn_core.runtime.store_auth import UnauthenticatedWrite

        seen: dict[int, tuple[int, float, str]] = {}  # node -> (seq, when it advanced, host)
        left: set[int] = set()  # nodes that said they left on purpose
        last_ok = time.monotonic()
        while not self._stop.wait(self.every_s):
            if self.workers is not None:
                self.workers.record()
            for at, got in self._answered():
                if isinstance(got, UnauthenticatedWrite):
                    self._silent(str(got))
                    return
                if isinstance(got, Exception):  # the store did not answer: a new client
                    self._store = None
                    continue
                last_ok = at
                for node, (seq, host, done) in got.items():
                    if done:
                        left.add(node)
                    if node not in seen or seq > seen[node][0]:
                        seen[node] = (seq, at, host)
            self._ask()
            now = time.monotonic()
            if now - last_ok > self.timeout_s:
                self._silent(
                    f"the rendezvous store at {self.endpoint} did not answer this node "
                    f"({socket.gethostname()}) for {now - last_ok:.0f} s "
                    f"(the liveness timeout, {self.timeout_s:.0f} s): a network partition or "
                    "the store's node died; stopping this node's workers"
                )
                self._end_if_still_cut_off()
                return
            for node, (_, when, name) in sorted(seen.items()):
                if node not in left and now - when > self.timeout_s:
                    self._silent(
                        f"node {name} (node rank {node}, global ranks {self.ranks_of(node)}) "
                        f"went silent: no liveness beat for {now - when:.0f} s "
                        f"(the liveness timeout, {self.timeout_s:.0f} s) in the rendezvous store "
                        f"at {self.endpoint}; stopping this node's workers"
                    )
                    return

    def _end_if_still_cut_off(self) -> None:
        """The store stays silent after this node's workers were stopped: torch's agent is
        then stuck in a store call that does not return (measured on a partitioned link: over
        3 minutes, its 60 s timeout notwithstanding), so the node would never end. After
        `CUT_OFF_GRACE_S` more without an answer, this ends the agent's process (exit 1),
        after `when_cut_off` hooks (the enn launcher's exit record). An answer, or the agent
        ending on its own (`stop()`), first: nothing is done."""
        if not self.in_agent:
            return
        deadline = time.monotonic() + max(self.timeout_s, CUT_OFF_GRACE_S)
        while not self._stop.wait(self.every_s):
            if any(not isinstance(got, Exception) for _, got in self._answered()):
                return  # the store answers again: torch's agent takes it from here
            self._ask()
            if time.monotonic() > deadline:
                line = (
                    f"the rendezvous store at {self.endpoint} is still unreachable and torch's "
                    "agent cannot end on its own; ending this node's agent (exit 1)"
                )
                log.error("%s", line)
                for hook in _when_cut_off:
                    with contextlib.suppress(Exception):
                        hook(line)
                logging.shutdown()
                os._exit(1)

    def _silent(self, line: str) -> None:
        log.error("%s", line)
        self.on_silent(line)

    def _stop_workers(self, line: str) -> None:
        self.stopped = line  # before the kill: the agent then sees its workers fail
        if self.workers is not None:
            killed = self.workers.stop()
            log.error(
                "stopped this node's workers (pids %s)", ", ".join(map(str, killed)) or "none"
            )


class Workers:
    """The workers of this agent in one rendezvous round: its direct children that appeared
    after the round began (torch's agent starts them right after the rendezvous), each recorded
    by pid and start time when first seen. A pid alone is never trusted: by the time a peer is
    named silent, a worker may have ended and its pid gone to another process. A child the
    agent had before the round (a server it started, a previous round's worker) is not one."""

    def __init__(self, parent: int | None = None) -> None:
        self.parent = parent or os.getpid()
        self.before = self._children()  # pid -> start time, at the rendezvous
        self.seen: dict[int, float] = {}  # pid -> start time of each worker

    def _children(self) -> dict[int, float]:
        found = {}
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.parent).children(recursive=False):
                with contextlib.suppress(psutil.Error):
                    found[child.pid] = child.create_time()
        return found

    def record(self) -> None:
        """The children that appeared since the rendezvous (the beat loop calls this)."""
        for pid, started in self._children().items():
            if not _same(self.before.get(pid), started):
                self.seen[pid] = started

    def stop(self) -> list[int]:
        """SIGKILL every recorded worker that is still the process recorded (the same pid
        and start time); returns the pids signalled."""
        self.record()
        killed = []
        for pid, started in sorted(self.seen.items()):
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if _same(proc.create_time(), started):
                    proc.kill()  # psutil checks the start time once more
                    killed.append(pid)
        return killed


def _same(started: float | None, other: float) -> bool:
    """Whether two start times read for one pid are one process's."""
    return started is not None and abs(started - other) <= START_TOLERANCE_S
