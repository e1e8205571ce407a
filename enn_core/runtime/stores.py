"""TCP stores that listen only on the address they are meant for.

A `TCPStore` server binds every interface (`*:PORT`), whatever host it is given: during
distributed-train the agent's rendezvous store and, on multi-node jobs, rank 0's workers' store
listened on every network the machine has (FIELD_NOTES). A store created on a socket bound to
one address (`master_listen_fd`) stays on it: 127.0.0.1 for a one-node job, the configured
`runtime.rdzv_endpoint` host (and the rank-0 node's address) for a multi-node one.

    store = tcp_store(host, port, is_master=True, timeout=timedelta(seconds=60))
    register_rendezvous()   # the "enn-c10d" rendezvous backend: torch's c10d on such a store

torchrun finds the same backend by name (`torchrun --rdzv-backend enn-c10d ...`) through the
entry point `torchrun.handlers` -> `torchrun_handler` (pyproject.toml).
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

RENDEZVOUS_BACKEND = "enn-c10d"
LEAVE_WAIT_S = 10.0  # how long the store's host waits for the other nodes to close
# torch's switch for the agent's shared workers' store (read by the agent at each rendezvous)
NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` alone (not every interface), listening."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def tcp_store(
    host: str,
    port: int,
    *,
    is_master: bool,
    timeout: _dt.timedelta,
    multi_tenant: bool = False,
    wait_for_workers: bool = True,
) -> dist.TCPStore:
    """A TCPStore; its server (when `is_master`) listens on `host`'s address only."""
    if not is_master:
        return dist.TCPStore(
            host, port, is_master=False, timeout=timeout, multi_tenant=multi_tenant
        )
    sock = listening_socket(host, port)
    return dist.TCPStore(
        host,
        sock.getsockname()[1],
        is_master=True,
        timeout=timeout,
        multi_tenant=multi_tenant,
        wait_for_workers=wait_for_workers,
        master_listen_fd=sock.detach(),  # the store owns the descriptor from here
    )


def _rendezvous_store(endpoint: str, read_timeout_s: int) -> tuple[dist.TCPStore, bool]:
    """The rendezvous store, hosted by this process when the endpoint names this machine
    and nobody hosts it yet (torch's c10d backend decides the same way), else a client;
    and whether this process hosts it."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
    from torch.distributed.elastic.rendezvous.utils import (
        _matches_machine_hostname,
        parse_rendezvous_endpoint,
    )

    host, port = parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT)
    timeout = _dt.timedelta(seconds=read_timeout_s)
    if _matches_machine_hostname(host):
        try:
            return tcp_store(host, port, is_master=True, timeout=timeout, multi_tenant=True), True
        except OSError:  # another agent on this machine hosts it: join as a client
            pass
    return tcp_store(host, port, is_master=False, timeout=timeout, multi_tenant=True), False


def _leave(store: dist.TCPStore, run_id: str, nodes: int, hosting: bool, wait_s: float) -> None:
    """After this node closed its part of the rendezvous: count it out, and on the node that
    hosts the store, wait (at most `wait_s`) until every node has: the store dies with this
    process, and an agent that still closes its part finds no store and prints a C++
    traceback (torch's shutdown after a successful job, seen on every node but the host's)."""
    key = f"enn/{run_id}/closed"
    try:
        store.add(key, 1)
        deadline = time.monotonic() + wait_s
        while hosting and store.add(key, 0) < nodes and time.monotonic() < deadline:
            time.sleep(0.1)
    except (RuntimeError, OSError):  # the host is gone already: nothing to wait for
        pass


def _create_handler(params: Any) -> Any:
    """torch's c10d rendezvous handler, on a store bound to the endpoint's address, whose
    workers' store (the agent shares it with its workers) is bound to the node's address."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        create_handler,
    )

    class Backend(C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return RENDEZVOUS_BACKEND  # what the registry checks the handler against

    class Handler(DynamicRendezvousHandler):
        def _create_tcp_store_server(self, master_addr: str, master_port: int) -> dist.TCPStore:
            # torch's own binds every interface (torch 2.13's method, overridden)
            return tcp_store(
                master_addr,
                master_port,
                is_master=True,
                timeout=_dt.timedelta(seconds=300),  # TCPStore's default
                multi_tenant=True,
            )

        def shutdown(self) -> bool:
            closed = super().shutdown()
            # the nodes of the last round (one that never met its peers waits for nobody)
            nodes = len(self._state_holder.state.participants) or 1
            _leave(store, params.run_id, nodes, hosting, LEAVE_WAIT_S)
            return closed

    if params.max_nodes > 1:
        # Several nodes: rank 0's worker hosts a fresh workers' store each round, bound to its
        # node's address (enn_core.runtime.dist._store); torch's shared agent store keys
        # attempts by a restart count the nodes need not agree on. Our own launcher sets this
        # too (launch.clean_dist_env); under torchrun this handler runs in its agent.
        os.environ[NO_SHARED_STORE] = "1"
    store, hosting = _rendezvous_store(params.endpoint, params.get_as_int("read_timeout", 60) or 60)
    handler = create_handler(store, Backend(store, params.run_id), params)
    handler.__class__ = Handler  # the same handler, with the bound workers' store
    return handler


def torchrun_handler() -> Callable[[Any], Any]:
    """What torchrun's `--rdzv-backend enn-c10d` finds: torch loads the entry points of the
    group `torchrun.handlers` (pyproject.toml names this function), calls each with no
    arguments and registers what it returns under the entry point's name."""
    return _create_handler


def register_rendezvous() -> str:
    """Register (idempotent) and return the rendezvous backend name elastic agents use:
    torch's c10d rendezvous on a store bound to the endpoint's address."""
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

    rendezvous_handler_registry.register(RENDEZVOUS_BACKEND, _create_handler)
    return RENDEZVOUS_BACKEND
