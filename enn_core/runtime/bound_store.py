"""TCP stores whose server listens only on the address it is meant for.

A `TCPStore` server binds every interface (`*:PORT`), whatever host it is given (FIELD_NOTES).
One created on a socket bound to one address (`master_listen_fd`) stays on it. The rendezvous
backend (enn_core.runtime.stores), each node's liveness beat (enn_core.runtime.liveness) and
the workers' process group (enn_core.runtime.dist) make their stores here.
"""

from __future__ import annotations

import datetime as _dt
import socket

import torch.distributed as dist


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
