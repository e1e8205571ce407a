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

import binascii
import datetime as _dt
import json
import logging
import os
import secrets
import socket
import threading
import time
from base64 import b64decode, b64encode
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from enn_core.errors import ConfigError
from enn_core.runtime import secret
from enn_core.runtime.bound_store import tcp_store

log = logging.getLogger("enn.launch")
WAITING_EXTRA = "enn_waiting"  # a waiting line's record attribute: whom it waits for
RENDEZVOUS_BACKEND = "enn-c10d"
WAITING_EVERY_S = 30.0  # how often a node waiting in the rendezvous says whom it waits for
# seconds without a peer node's liveness beat before it is named silent (runtime.hang_timeout_s:
# the launcher passes it as the rendezvous config `liveness_timeout`; torchrun: --rdzv-conf)
LIVENESS_TIMEOUT_S = 120
LEAVE_WAIT_S = 10.0  # how long the store's host waits for the other nodes to close
# torch's switch for the agent's shared workers' store (read by the agent at each rendezvous)
NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _rendezvous_store(
    endpoint: str, read_timeout_s: int, connect_timeout_s: int
) -> tuple[dist.TCPStore, bool]:
    """The rendezvous store, hosted by this process when the endpoint names this machine
    and nobody hosts it yet (torch's c10d backend decides the same way), else a client;
    and whether this process hosts it. An endpoint that does not answer within
    `connect_timeout_s` (runtime.rdzv_timeout_s) is one line naming it."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
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


def _backend_class() -> type:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    # imported here: store_auth imports torch's rendezvous package, whose registry imports
    # this module (torchrun's entry point) while it loads
    from enn_core.runtime.store_auth import seal, unseal

    class Backend(C10dRendezvousBackend):
        """torch's c10d backend whose state carries an HMAC bound to the run id and the
        launch, checked before the state (a pickle) reaches torch's unpickling state holder."""

        def __init__(
            self, store: Any, run_id: str, key: bytes, where: str, launch: str = ""
        ) -> None:
            # the MAC's context: the run id and this launch's nonce (`launch_nonce`)
            self._mac_key, self._run_id, self._where = key, f"{run_id}/{launch}", where
            super().__init__(store, run_id)

        @property
        def name(self) -> str:
            return RENDEZVOUS_BACKEND  # what the registry checks the handler against

        def _open(self, stored: bytes) -> tuple[bytes, Any] | None:
            if stored == self._NULL_SENTINEL.encode():
                return None
            try:
                raw = b64decode(stored, validate=True)
            except binascii.Error:
                raw = b""  # not even base64: it fails its MAC below, as anything forged does
            state = unseal(self._mac_key, "the rendezvous state", self._run_id, raw, self._where)
            return state, stored

        def get_state(self) -> tuple[bytes, Any] | None:
            return self._open(self._call_store("get", self._key))

        def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
            if token and not isinstance(token, bytes):
                current = self.get_state()
                return (*current, False) if current is not None else None
            sealed = seal(self._mac_key, "the rendezvous state", self._run_id, state)
            expected = token.decode() if token else self._NULL_SENTINEL
            stored = self._call_store(
                "compare_set", self._key, expected, b64encode(sealed).decode()
            )
            current = self._open(stored)
            if current is None:
                return None
            return current[0], current[1], current[0] == state

    return Backend


def _create_handler(params: Any) -> Any:
    """torch's c10d rendezvous handler, on a store bound to the endpoint's address, whose
    workers' store (the agent shares it with its workers) is bound to the node's address,
    every value of which is authenticated with the job secret."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        create_handler,
    )

    from enn_core.runtime.liveness import Liveness
    from enn_core.runtime.store_auth import MacStore

    key = job_key(params.max_nodes)

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

        def _get_store(self) -> Any:
            # what the agent reads MASTER_ADDR/PORT, the rank assignment and its barrier from
            round_ = self._state_holder.state.round
            context = f"{params.run_id}/{launch}/{round_}"
            return MacStore(super()._get_store(), key, context, params.endpoint)

        def next_rendezvous(self) -> Any:
            agree_on_nodes(store, key, params, launch)
            waiting = Waiting(self, params, WAITING_EVERY_S)
            threading.Thread(target=waiting.run, name="enn-rdzv-waiting", daemon=True).start()
            beat = getattr(self, "_enn_liveness", None)
            if beat is not None:  # a new round: this node leaves the last one on purpose
                beat.stop()
            try:
                info = super().next_rendezvous()
            except RendezvousTimeoutError:
                waiting.say()  # torchrun's own error says no more than its class
                raise
            finally:
                waiting.stop.set()
            if params.max_nodes > 1:
                self._enn_liveness = Liveness(
                    params.endpoint,
                    key,
                    params.run_id,
                    self._state_holder.state.round,
                    info.rank,
                    info.world_size,
                    assigned_ranks(self._get_store()),
                    float(params.get_as_int("liveness_timeout", LIVENESS_TIMEOUT_S) or 1),
                ).start()
            return info

        def shutdown(self) -> bool:
            beat = getattr(self, "_enn_liveness", None)
            if beat is not None:  # the job ended here: the others must not call it silent
                beat.stop()
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
    store, hosting = _rendezvous_store(
        params.endpoint,
        params.get_as_int("read_timeout", 60) or 60,
        params.get_as_int("join_timeout", 600) or 600,
    )
    launch = launch_nonce(store, key, params.run_id, hosting, params.endpoint)
    backend = _backend_class()(store, params.run_id, key, params.endpoint, launch)
    handler = create_handler(store, backend, params)
    handler.__class__ = Handler  # the same handler, with the bound workers' store
    return handler


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


def assigned_ranks(store: Any) -> Callable[[int], str]:
    """A node's global ranks as the agents assigned them in this round (the sealed store's
    torchelastic keys), for naming a silent node; "unknown" before they were assigned."""

    from torch.distributed.elastic.rendezvous.api import RendezvousError

    def ranks_of(node: int) -> str:
        keys = [f"torchelastic/assigned_ranks/{node}", f"torchelastic/role_info/{node}"]
        try:
            if not store.check(keys):
                return "unknown"
            base = int(json.loads(store.get(keys[0]))[0])
            local = int(json.loads(store.get(keys[1]))["local_world_size"])
        except (RuntimeError, ValueError, KeyError, IndexError, RendezvousError):
            return "unknown"
        return str(base) if local == 1 else f"{base}-{base + local - 1}"

    return ranks_of


class Waiting:
    """Whom this node still waits for in the rendezvous: sampled every second from the
    handler's state while it waits, one line every `every_s` seconds, and once more when the
    rendezvous times out (torch's state has dropped this node by then: the last sample)."""

    def __init__(self, handler: Any, params: Any, every_s: float) -> None:
        self.handler, self.params, self.every_s = handler, params, every_s
        self.stop = threading.Event()
        self.who = ""

    def sample(self) -> None:
        state = self.handler._state_holder.state  # a snapshot; the agent's thread replaces it
        seen = sorted({n.addr for n in (*state.participants, *state.wait_list)})
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
