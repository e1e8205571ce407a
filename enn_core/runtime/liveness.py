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
timeout.

    beat = Liveness(endpoint, key, run_id, round_, node_rank, nnodes, ranks_of, timeout_s)
    beat.start(); ...; beat.stop()   # posts a last beat saying this node left on purpose
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

log = logging.getLogger("enn.launch")
EVERY_S = 2.0


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
        self.on_silent = on_silent or stop_workers
        self._stop = threading.Event()
        self._store: Any = None
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="enn-liveness", daemon=True)

    def _key(self, node: int) -> str:
        return f"enn/{self.run_id}/round{self.round}/alive/{node}"

    def start(self) -> Liveness:
        self._thread.start()
        return self

    def stop(self) -> None:
        """This node leaves the round on purpose (the job ended, or a restart): a last beat
        says so, and the others do not take its silence for a failure."""
        self._stop.set()
        self._thread.join(timeout=self.every_s * 3)
        self._post(done=True)

    def _post(self, *, done: bool = False) -> None:
        from enn_core.runtime.store_auth import seal
        from enn_core.runtime.stores import tcp_store

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
            value = seal(self.key, "a beat", self.run_id, json.dumps(beat).encode())
            self._store.set(self._key(self.node_rank), value)
            self._seq += 1

    def _run(self) -> None:
        from enn_core.runtime.store_auth import UnauthenticatedWrite, unseal

        seen: dict[int, tuple[int, float, str]] = {}  # node -> (seq, when it advanced, host)
        left: set[int] = set()  # nodes that said they left on purpose
        last_ok = time.monotonic()
        while not self._stop.wait(self.every_s):
            now = time.monotonic()
            try:
                self._post()
                if self._store is None:
                    raise OSError("no store")
                for node in range(self.nnodes):
                    key = self._key(node)
                    if node == self.node_rank or not self._store.check([key]):
                        continue
                    got = json.loads(
                        unseal(self.key, "a beat", self.run_id, self._store.get(key), self.endpoint)
                    )
                    if got.get("done"):
                        left.add(node)
                    if node not in seen or got["seq"] > seen[node][0]:
                        seen[node] = (int(got["seq"]), now, str(got["host"]))
                last_ok = now
            except UnauthenticatedWrite as e:
                self._silent(str(e))
                return
            except (RuntimeError, OSError, ValueError, KeyError):  # the store did not answer
                self._store = None
                if now - last_ok > self.timeout_s:
                    self._silent(
                        f"the rendezvous store at {self.endpoint} did not answer this node "
                        f"({socket.gethostname()}) for {now - last_ok:.0f} s "
                        f"(runtime.hang_timeout_s={self.timeout_s:.0f}): a network partition or "
                        "the store's node died; stopping this node's workers"
                    )
                    return
                continue
            for node, (_, when, name) in sorted(seen.items()):
                if node not in left and now - when > self.timeout_s:
                    self._silent(
                        f"node {name} (node rank {node}, global ranks {self.ranks_of(node)}) "
                        f"went silent: no liveness beat for {now - when:.0f} s "
                        f"(runtime.hang_timeout_s={self.timeout_s:.0f}) in the rendezvous store "
                        f"at {self.endpoint}; stopping this node's workers"
                    )
                    return

    def _silent(self, line: str) -> None:
        log.error("%s", line)
        self.on_silent(line)


def stop_workers(_line: str) -> None:
    """SIGKILL this agent's worker processes: its direct children started after the
    rendezvous (never a server it started before, such as enn run's Prefect API)."""
    me = psutil.Process()
    for child in me.children(recursive=False):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(child.cmdline())
            if "spawn_main" in cmd or "forkserver" in cmd or "flows.worker" in cmd:
                os.kill(child.pid, signal.SIGKILL)
