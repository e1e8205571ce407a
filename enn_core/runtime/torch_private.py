"""The one module that names torch's private members of its c10d rendezvous, elastic agent,
process groups and FSDP2 (issue 53.2): everything else calls the functions here.

torch is pinned (pyproject.toml, constraints.txt), but none of these is its public API: the
next version may rename, move or re-sign any of them. `PRIVATE` lists each one with what this
project uses it for and what breaks when it changes; tests/unit/runtime/test_torch_private.py
checks every entry against the installed torch (it exists, with the parameters named here; the
attribute chains on a real handler and backend; torch still calls the two overridden hooks in a
one-node rendezvous) and fails when a module outside this one names any of them. What to do
when torch moves: docs/design.md, "When torch moves".

    handler = make_handler(store, backend, params, hooks)  # torch's handler, our hooks
    state_of(handler).round                                  # the rendezvous round
    backend = sealed_backend(store, run_id, name, seal, unseal)

torch's rendezvous packages are imported inside the functions: the package's registry loads
the `torchrun.handlers` entry point (enn_core.runtime.stores) while it imports, and the enn
parent imports stores without needing torch's elastic code.
"""

from __future__ import annotations

import binascii
import datetime as _dt
import json
import re
from base64 import b64decode, b64encode
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch.distributed as dist

DYNAMIC = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
C10D_BACKEND = "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend"
UTILS = "torch.distributed.elastic.rendezvous.utils"
AGENT = "torch.distributed.elastic.agent.server.api"
C10D = "torch.distributed.distributed_c10d"
FSDP2 = "torch.distributed.fsdp._fully_shard._fully_shard"
# torch's switch for the agent's shared workers' store (read by the handler at each rendezvous)
NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
ASSIGNED_RANKS = "torchelastic/assigned_ranks/"  # the agent's keys in the rendezvous store
ROLE_INFO = "torchelastic/role_info/"


@dataclass(frozen=True)
class Private:
    """One member of torch's that is not its public API, as this module relies on it."""

    where: str
    """The torch module that defines it."""
    owner: str
    """Its class; "" for a module's function or a string in the module's source."""
    name: str
    """The attribute (a dotted chain for `on="instance"`), function or string."""
    on: Literal["class", "instance", "module", "source"]
    """Where the test looks: the class, a real instance (handler, backend), the module, or
    the module's source text (a string torch reads or writes)."""
    params: tuple[str, ...] | None
    """The parameter names we call or override it with; None: not called."""
    use: str
    breaks: str
    grep: str = ""
    """The regular expression that finds it in our code; "" means its private names."""

    def patterns(self) -> list[str]:
        """Regular expressions that find a use of it in a source file."""
        if self.grep:
            return [self.grep]
        if self.on == "source":
            return [re.escape(self.name)]
        parts = [self.owner, *self.name.split(".")]
        return [rf"\b{re.escape(p)}\b" for p in parts if p.startswith("_")]


PRIVATE: tuple[Private, ...] = (
    Private(
        DYNAMIC,
        "DynamicRendezvousHandler",
        "_create_tcp_store_server",
        "class",
        ("self", "master_addr", "master_port"),
        "overridden: the agent's shared workers' store (one node) listens on the node's "
        "address only (enn_core.runtime.bound_store)",
        "renamed or no longer called: silently, that store listens on every interface again",
    ),
    Private(
        DYNAMIC,
        "DynamicRendezvousHandler",
        "_get_store",
        "class",
        ("self",),
        "overridden and called: the store the agent reads MASTER_ADDR/PORT, the rank "
        "assignment and its barriers from, every value sealed (store_auth.MacStore)",
        "renamed: silently, the agent trusts unauthenticated values again",
    ),
    Private(
        DYNAMIC,
        "DynamicRendezvousHandler",
        "_state_holder.state.round",
        "instance",
        None,
        "the round: in the sealed agent store's MAC context and each node's liveness beat",
        "AttributeError at the first rendezvous",
    ),
    Private(
        DYNAMIC,
        "DynamicRendezvousHandler",
        "_state_holder.state.participants",
        "instance",
        None,
        "the round's nodes (keys with `.addr`): the waiting line, and how many nodes the "
        "store's host waits for at shutdown",
        "AttributeError in the waiting line's thread, or at shutdown",
    ),
    Private(
        DYNAMIC,
        "DynamicRendezvousHandler",
        "_state_holder.state.wait_list",
        "instance",
        None,
        "the nodes seen waiting for the next round: the waiting line",
        "AttributeError in the waiting line's thread",
    ),
    Private(
        DYNAMIC,
        "_NodeDesc",
        "addr",
        "class",
        None,
        "a node's address, as the waiting line names it",
        "AttributeError in the waiting line's thread",
    ),
    Private(
        DYNAMIC,
        "",
        "create_handler",
        "module",
        ("store", "backend", "params"),
        "public, but we swap the class of the handler it returns for our subclass (torch "
        "parses the rendezvous config; no public way to make it build a subclass)",
        "a handler of another class, or one with __slots__: the swap fails (TypeError) or "
        "drops torch's own overrides",
    ),
    Private(
        C10D_BACKEND,
        "C10dRendezvousBackend",
        "_NULL_SENTINEL",
        "class",
        None,
        "the value torch stores for 'no state yet': never opened as a sealed state",
        "a fresh rendezvous fails its MAC check (UnauthenticatedWrite) on every node",
    ),
    Private(
        C10D_BACKEND,
        "C10dRendezvousBackend",
        "_call_store",
        "class",
        ("self", "store_op", "args", "kwargs"),
        "get and compare_set of the state, with torch's translation of a lost store into "
        "RendezvousConnectionError",
        "AttributeError at the first rendezvous",
    ),
    Private(
        C10D_BACKEND,
        "C10dRendezvousBackend",
        "_key",
        "instance",
        None,
        "the store key of the rendezvous state",
        "AttributeError at the first rendezvous",
        grep=r"\._key\b(?!\()",  # liveness.Liveness has a method of that name
    ),
    Private(
        UTILS,
        "",
        "_matches_machine_hostname",
        "module",
        ("host",),
        "whether the endpoint names this machine: host the rendezvous store, or join it",
        "ImportError at the first rendezvous",
    ),
    Private(
        C10D,
        "",
        "_set_pg_timeout",
        "module",
        ("timeout", "group"),
        "the shorter collective timeout after warm-up (torch has no public setter)",
        "AttributeError in every worker after its first step",
    ),
    Private(
        DYNAMIC,
        "",
        NO_SHARED_STORE,
        "source",
        None,
        "set on several nodes: rank 0's worker makes each round's workers' store "
        "(enn_core.runtime.dist), not the agent's shared one",
        "ignored: the nodes' workers meet on torch's shared store, keyed by a restart count "
        "the nodes need not agree on",
    ),
    Private(
        AGENT,
        "",
        ASSIGNED_RANKS,
        "source",
        None,
        "a node's first global rank (JSON list), to name a silent node's ranks",
        "a silent node's ranks are named 'unknown'",
    ),
    Private(
        AGENT,
        "",
        ROLE_INFO,
        "source",
        None,
        "a node's local world size (JSON, `local_world_size`), to name its ranks",
        "a silent node's ranks are named 'unknown'",
    ),
    Private(
        FSDP2,
        "FSDPModule",
        "_set_unshard_async_op",
        "class",
        ("self", "async_op"),
        "on the CPU, FSDP2 frees a unit's all-gather buffer once copied out instead of "
        "holding it until the next unit's (enn_core.runtime.dist): one unit less at the peak",
        "AttributeError when a CPU job shards its model; renamed to a no-op: each worker's "
        "forward holds one unit more again",
    ),
)


@dataclass(frozen=True)
class RoundState:
    """What this project reads of torch's rendezvous state (a snapshot)."""

    round: int
    participants: tuple[str, ...]
    """The address of each node in the round (one entry per node)."""
    waiting: tuple[str, ...]
    """The address of each node waiting for the next round."""


class Hooks(Protocol):
    """What a handler made by `make_handler` calls (enn_core.runtime.stores)."""

    def workers_store_server(self, addr: str, port: int) -> dist.TCPStore:
        """The agent's shared workers' store, served on `addr`:`port`."""
        ...

    def agent_store(self, store: dist.Store, round_: int) -> Any:
        """The store the agent gets in round `round_`, given torch's."""
        ...

    def next_rendezvous(self, handler: Any, join: Callable[[], Any]) -> Any:
        """Around torch's `next_rendezvous` (`join()`)."""
        ...

    def shutdown(self, handler: Any, close: Callable[[], bool]) -> bool:
        """Around torch's `shutdown` (`close()`)."""
        ...


def make_handler(store: Any, backend: Any, params: Any, hooks: Hooks) -> Any:
    """torch's c10d dynamic rendezvous handler (`create_handler`), its class swapped for a
    subclass whose private hooks and public steps call `hooks`."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        create_handler,
    )

    class Handler(DynamicRendezvousHandler):
        def _create_tcp_store_server(self, master_addr: str, master_port: int) -> dist.TCPStore:
            return hooks.workers_store_server(master_addr, master_port)

        def _get_store(self) -> Any:
            return hooks.agent_store(super()._get_store(), self._state_holder.state.round)

        def next_rendezvous(self) -> Any:
            return hooks.next_rendezvous(self, super().next_rendezvous)

        def shutdown(self) -> bool:
            return hooks.shutdown(self, super().shutdown)

    handler = create_handler(store, backend, params)
    handler.__class__ = Handler  # the same handler (torch parsed the config), with our hooks
    return handler


def state_of(handler: Any) -> RoundState:
    """The handler's rendezvous state now (the agent's thread replaces it as it syncs)."""
    state = handler._state_holder.state
    return RoundState(
        round=int(state.round),
        participants=tuple(n.addr for n in list(state.participants)),
        waiting=tuple(n.addr for n in list(state.wait_list)),
    )


def agent_store(handler: Any) -> Any:
    """The store the handler gives the agent this round (through `Hooks.agent_store`)."""
    return handler._get_store()


def sealed_backend(
    store: Any,
    run_id: str,
    name: str,
    seal: Callable[[bytes], bytes],
    unseal: Callable[[bytes], bytes],
) -> Any:
    """torch's c10d rendezvous backend under the name `name`, whose state (a pickle torch's
    state holder unpickles) is stored as `seal(state)` and read back through `unseal`, which
    raises on a value nobody of the job wrote, before torch unpickles anything."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    class Backend(C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return name  # what the registry checks the handler against

        def _open(self, stored: bytes) -> tuple[bytes, Any] | None:
            if stored == self._NULL_SENTINEL.encode():
                return None
            try:
                raw = b64decode(stored, validate=True)
            except binascii.Error:
                raw = b""  # not even base64: it fails `unseal`, as anything forged does
            return unseal(raw), stored

        def get_state(self) -> tuple[bytes, Any] | None:
            return self._open(self._call_store("get", self._key))

        def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
            if token and not isinstance(token, bytes):
                current = self.get_state()
                return (*current, False) if current is not None else None
            expected = token.decode() if token else self._NULL_SENTINEL
            new = b64encode(seal(state)).decode()
            current = self._open(self._call_store("compare_set", self._key, expected, new))
            if current is None:
                return None
            return current[0], current[1], current[0] == state

    return Backend(store, run_id)


def names_this_machine(host: str) -> bool:
    """Whether `host` (a rendezvous endpoint's) is this machine, as torch's c10d backend
    decides whether to host the store."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return bool(_matches_machine_hostname(host))


def set_default_timeout(timeout: _dt.timedelta) -> None:
    """The default process group's collective timeout, from now on."""
    from torch.distributed import distributed_c10d

    distributed_c10d._set_pg_timeout(timeout, None)


def assigned_ranks(store: Any) -> Callable[[int], str]:
    """A node's global ranks as the agents assigned them in this round (the agent's keys in
    `store`), for naming a silent node; "unknown" before they were assigned."""
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    def ranks_of(node: int) -> str:
        keys = [f"{ASSIGNED_RANKS}{node}", f"{ROLE_INFO}{node}"]
        try:
            if not store.check(keys):
                return "unknown"
            base = int(json.loads(store.get(keys[0]))[0])
            local = int(json.loads(store.get(keys[1]))["local_world_size"])
        except (RuntimeError, ValueError, KeyError, IndexError, RendezvousError):
            return "unknown"
        return str(base) if local == 1 else f"{base}-{base + local - 1}"

    return ranks_of


def unshard_without_deferral(model: Any) -> None:
    """FSDP2's pre-forward and pre-backward all-gathers of `model` and its FSDP2 submodules
    with async_op=True: each unit's all-gather buffer is freed once copied out, not kept
    until the next unit's (what a CUDA stream's overlap needs, and a CPU's memory pays for).
    The timed all-gather (enn_core.runtime.comm_clock) waits for the Work it returns."""
    model._set_unshard_async_op(True)
