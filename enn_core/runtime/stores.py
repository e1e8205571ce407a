"""The "enn-c10d" rendezvous backend: torch's c10d rendezvous on TCP stores that listen only
on the address they are meant for (enn_core.runtime.bound_store).

A `TCPStore` server binds every interface (`*:PORT`), whatever host it is given: during
distributed-train the agent's rendezvous store and, on multi-node jobs, rank 0's workers' store
listened on every network the machine has (FIELD_NOTES). Here they stay on 127.0.0.1 for a
one-node job, the configured `runtime.rdzv_endpoint` host (and the rank-0 node's address) for a
multi-node one.

    store = tcp_store(host, port, is_master=True, timeout=timedelta(seconds=60))
    register_rendezvous()   # the "enn-c10d" rendezvous backend: torch's c10d on such a store

torchrun finds the same backend by name (`torchrun --rdzv-backend enn-c10d ...`) through the
entry point `torchrun.handlers` -> `torchrun_handler` (pyproject.toml).

What this adds to torch's handler and backend (`Hooks`, `rendezvous_backend`) reaches torch
through enn_core.runtime.torch_private, the one module that names torch's private members.

Authenticated (enn_core.runtime.store_auth): the rendezvous state is stored with an HMAC keyed
by the job secret (enn_core.runtime.secret) and bound to the run id and the launch (a nonce the
store's host draws, `launch_nonce`: a state replayed from an earlier job with the same id and
secret fails), checked before torch
unpickles it; the store the handler gives the agent (the workers' MASTER_ADDR/MASTER_PORT, the
rank assignment) seals and checks every value the same way. A job of several nodes needs a
secret (one line without); a one-node job without one makes a fresh key in memory per launch
(its only agent is the only reader), so a local user reaching the loopback port cannot forge
either.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from enn_core.errors import ConfigError
from enn_core.runtime import secret, torch_private
from enn_core.runtime.bound_store import tcp_store
from enn_core.runtime.torch_private import NO_SHARED_STORE

log = logging.getLogger("enn.launch")
WAITING_EXTRA = "enn_waiting"  # a waiting line's record attribute: whom it waits for
RENDEZVOUS_BACKEND = "enn-c10d"
WAITING_EVERY_S = 30.0  # how often a node waiting in the rendezvous says whom it waits for
# seconds without a peer node's liveness beat before it is named silent (runtime.hang_timeout_s:
# the launcher passes it as the rendezvous config `liveness_timeout`; torchrun: --rdzv-conf)
LIVENESS_TIMEOUT_S = 120
LEAVE_WAIT_S = 10.0  # how long the store's host waits for the other nodes to close


def _rendezvous_store(
    endpoint: str, read_timeout_s: int, connect_timeout_s: int
) -> tuple[dist.TCPStore, bool]:
    """The rendezvous store, hosted by this process when the endpoint names this machine
    and nobody hosts it yet (torch's c10d backend decides the same way), else a client;
    and whether this process hosts it. An endpoint that does not answer within
    `connect_timeout_s` (runtime.rdzv_timeout_s) is one line naming it."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT)
    timeout = _dt.timedelta(seconds=read_timeout_s)
    if torch_private.names_this_machine(host):
        try:
            return tcp_store(host, port, is_master=True, timeout=timeout, multi_tenant=True), True
        except OSError:  # another agent on this machine hosts it: join as a client
            pass
    try:
        client = tcp_store(
            host,
            port,
            is_master=False,
            timeout=_dt.timedelta(seconds=connect_timeout_s),
            multi_tenant=True,
        )
    except (RuntimeError, ValueError, TimeoutError, OSError) as e:
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise RendezvousConnectionError(
            f"the rendezvous endpoint {endpoint} did not answer within {connect_timeout_s} s "
            f"({first}); start the node it names first (it hosts the store), check that "
            f"{host} resolves to it here and that port {port} is open between the nodes"
        ) from None
    client.set_timeout(timeout)
    return client, False


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


def job_key(max_nodes: int) -> bytes:
    """The rendezvous' MAC key: the job secret; on one node without one, a fresh key."""
    key = secret.load()
    if key is not None:
        return key
    if max_nodes > 1:
        raise ConfigError(
            f"a job of up to {max_nodes} nodes needs a job secret in {secret.ENV} (the "
            f"rendezvous store authenticates every value with it); {secret.how_to_make()}"
        )
    return secrets.token_bytes(32)


def rendezvous_backend(store: Any, run_id: str, key: bytes, where: str, launch: str = "") -> Any:
    """torch's c10d backend whose state carries an HMAC bound to the run id and the launch,
    checked before the state (a pickle) reaches torch's unpickling state holder."""
    # imported here: store_auth imports torch's rendezvous package, whose registry imports
    # this module (torchrun's entry point) while it loads
    from enn_core.runtime.store_auth import seal, unseal

    what, context = "the rendezvous state", f"{run_id}/{launch}"  # the launch: `launch_nonce`
    return torch_private.sealed_backend(
        store,
        run_id,
        RENDEZVOUS_BACKEND,
        seal=lambda state: seal(key, what, context, state),
        unseal=lambda raw: unseal(key, what, context, raw, where),
    )


class Hooks:
    """What the enn-c10d handler adds to torch's (enn_core.runtime.torch_private.Hooks), for one
    handler: the bound and sealed stores, the node count agreed, the waiting line, each
    round's liveness beat and the leaving count at shutdown."""

    def __init__(self, params: Any, key: bytes, store: Any, hosting: bool, launch: str) -> None:
        self.params, self.key, self.store, self.hosting = params, key, store, hosting
        self.launch = launch
        self.liveness: Any = None  # this node's beat of the newest round

    def workers_store_server(self, addr: str, port: int) -> dist.TCPStore:
        # torch's own binds every interface
        return tcp_store(
            addr,
            port,
            is_master=True,
            timeout=_dt.timedelta(seconds=300),  # TCPStore's default
            multi_tenant=True,
        )

    def agent_store(self, store: dist.Store, round_: int) -> Any:
        # what the agent reads MASTER_ADDR/PORT, the rank assignment and its barrier from
        from enn_core.runtime.store_auth import MacStore

        context = f"{self.params.run_id}/{self.launch}/{round_}"
        return MacStore(store, self.key, context, self.params.endpoint)

    def next_rendezvous(self, handler: Any, join: Callable[[], Any]) -> Any:
        from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

        from enn_core.runtime.liveness import Liveness

        params = self.params
        agree_on_nodes(self.store, self.key, params, self.launch)
        waiting = Waiting(handler, params, WAITING_EVERY_S)
        threading.Thread(target=waiting.run, name="enn-rdzv-waiting", daemon=True).start()
        if self.liveness is not None:  # a new round: this node leaves the last one on purpose
            self.liveness.stop()
        try:
            info = join()
        except RendezvousTimeoutError:
            waiting.say()  # torchrun's own error says no more than its class
            raise
        finally:
            waiting.stop.set()
        if params.max_nodes > 1:
            self.liveness = Liveness(
                params.endpoint,
                self.key,
                params.run_id,
                torch_private.state_of(handler).round,
                info.rank,
                info.world_size,
                torch_private.assigned_ranks(torch_private.agent_store(handler)),
                float(params.get_as_int("liveness_timeout", LIVENESS_TIMEOUT_S) or 1),
            ).start()
        return info

    def shutdown(self, handler: Any, close: Callable[[], bool]) -> bool:
        if self.liveness is not None:  # the job ended here: the others must not call it silent
            self.liveness.stop()
        closed = close()
        # the nodes of the last round (one that never met its peers waits for nobody)
        nodes = len(torch_private.state_of(handler).participants) or 1
        _leave(self.store, self.params.run_id, nodes, self.hosting, LEAVE_WAIT_S)
        return closed


def _create_handler(params: Any) -> Any:
    """torch's c10d rendezvous handler, on a store bound to the endpoint's address, whose
    workers' store (the agent shares it with its workers) is bound to the node's address,
    every value of which is authenticated with the job secret."""
    key = job_key(params.max_nodes)
    if params.max_nodes > 1:
        # Several nodes: rank 0's worker hosts a fresh workers' store each round, bound to its
        # node's address (enn_core.runtime.dist._store); torch's shared agent store keys
        # attempts by a restart count the nodes need not agree on. Our own launcher sets this
        # too (launch.clean_dist_env); under torchrun this handler runs in its agent.
        os.environ[NO_SHARED_STORE] = "1"
    store, hosting = _rendezvous_store(
        params.endpoint,
        params.get_as_int("read_timeout", 60) or 60,
        params.get_as_int("join_timeout", 600) or 600,
    )
    launch = launch_nonce(store, key, params.run_id, hosting, params.endpoint)
    sealed = rendezvous_backend(store, params.run_id, key, params.endpoint, launch)
    hooks = Hooks(params, key, store, hosting, launch)
    return torch_private.make_handler(store, sealed, params, hooks)


def launch_nonce(store: Any, key: bytes, run_id: str, hosting: bool, endpoint: str) -> str:
    """This launch's nonce, which every MAC of the rendezvous binds beside the run id: the
    agent that hosts the (fresh) store draws it and stores it sealed; the others wait for it.
    A state, a value or a node count sealed by an earlier job with the same id and secret
    (replayed into this one's store) fails its MAC: that job had another nonce."""
    from enn_core.runtime.store_auth import seal, unseal

    where = f"enn/{run_id}/launch"
    if hosting:
        nonce = secrets.token_hex(16)
        store.set(where, seal(key, "the launch", run_id, nonce.encode()))
        return nonce
    store.wait([where])  # the host sets it right after it made the store
    return unseal(key, "the launch", run_id, store.get(where), endpoint).decode()


def agree_on_nodes(store: Any, key: bytes, params: Any, launch: str = "") -> None:
    """The first node to arrive records its node count (min, max) in the store (sealed);
    a node that counts otherwise is one line naming both (runtime.nnodes, torchrun's
    --nnodes), instead of waiting for a job that can never form."""
    from enn_core.runtime.store_auth import RendezvousNodesDiffer, seal, unseal

    mine = {"min": params.min_nodes, "max": params.max_nodes, "host": socket.gethostname()}
    context = f"{params.run_id}/{launch}"
    sealed = seal(key, "the node count", context, json.dumps(mine).encode())
    where = f"enn/{params.run_id}/nodes"
    first = store.compare_set(where, "", sealed)
    theirs = json.loads(unseal(key, "the node count", context, first, params.endpoint))
    if (theirs["min"], theirs["max"]) != (mine["min"], mine["max"]):
        raise RendezvousNodesDiffer(params.run_id, theirs, mine)


class Waiting:
    """Whom this node still waits for in the rendezvous: sampled every second from the
    handler's state while it waits, one line every `every_s` seconds, and once more when the
    rendezvous times out (torch's state has dropped this node by then: the last sample)."""

    def __init__(self, handler: Any, params: Any, every_s: float) -> None:
        self.handler, self.params, self.every_s = handler, params, every_s
        self.stop = threading.Event()
        self.who = ""

    def sample(self) -> None:
        state = torch_private.state_of(self.handler)
        seen = sorted({*state.participants, *state.waiting})
        missing = max(0, self.params.min_nodes - len(state.participants))
        who = f"{missing} more node(s) of {self.params.min_nodes}; seen: "
        self.who = who + (", ".join(seen) or "none yet")

    def run(self) -> None:
        said = time.monotonic()
        while not self.stop.wait(min(1.0, self.every_s)):
            self.sample()
            if time.monotonic() - said >= self.every_s:
                said = time.monotonic()
                self.say()

    def say(self) -> None:
        if not self.who:
            self.sample()
        p = self.params
        log.warning(
            "rendezvous %s at %s: still waiting for %s",
            p.run_id,
            p.endpoint,
            self.who,
            extra={WAITING_EXTRA: self.who},
        )


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
