"""Values in the rendezvous store, authenticated with the job secret (enn_core.runtime.secret).

The rendezvous store (a TCPStore) has no authentication: anyone who reaches its port can read
and write any key, and the job id is no secret (it is on every node's command line). torch's
dynamic rendezvous keeps its state there as a pickle that every agent unpickles, and the
agents read the workers' MASTER_ADDR/MASTER_PORT and their rank assignment from it. Here
every such value is sealed with an HMAC over (what it is, the job id and the launch's nonce,
the key, the value) and opened only when the MAC matches (a value an earlier job with the same
id and secret sealed fails: enn_core.runtime.stores.launch_nonce); a value that does not is
never used: the agent stops with `UnauthenticatedWrite`, one line naming the store's address.

A MAC stops forged values, not a denial of service: whoever reaches the port can still
delete or overwrite keys (the job then stops), replay a value this job wrote earlier under the
same key, or bump the counters (`add`) the agents' barriers count with. Keep the port behind
a network boundary too.

    sealed = seal(key, "state", run_id, value)         # bytes to store
    value = unseal(key, "state", run_id, sealed, where) # raises UnauthenticatedWrite
    store = MacStore(prefix_store, key, context, where) # set/get/multi_* sealed; add/wait as is
"""

from __future__ import annotations

import datetime as _dt
import logging
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousStateError

from enn_core.runtime import secret

log = logging.getLogger("enn.launch")
TAG = 32  # bytes of an HMAC-SHA256


class UnauthenticatedWrite(RendezvousStateError):
    """A value in the rendezvous store that no member of this job wrote (its MAC fails).

    A RendezvousError, so torch's agent stops the job (its shutdown path expects one)."""

    def __init__(self, where: str, what: str, run_id: str) -> None:
        super().__init__(
            f"the rendezvous store at {where} holds a value for {what} of job {run_id} that no "
            "member of the job wrote (an unauthenticated write: its HMAC with the job secret "
            "does not match); the job was stopped and the value never used. Someone else can "
            f"reach that port (keep it behind a network boundary), or the nodes were given "
            f"different job secrets ({secret.ENV})"
        )
        self.where, self.what = where, what


class RendezvousNodesDiffer(RendezvousError):
    """Nodes of one job that count its nodes differently (runtime.nnodes, --nnodes)."""

    def __init__(self, run_id: str, theirs: dict[str, Any], mine: dict[str, Any]) -> None:
        def count(d: dict[str, Any]) -> str:
            return str(d["max"]) if d["min"] == d["max"] else f"{d['min']}:{d['max']}"

        super().__init__(
            f"the nodes of job {run_id} disagree on runtime.nnodes: {theirs['host']} said "
            f"{count(theirs)}, this node ({mine['host']}) says {count(mine)}; give every node "
            "the same runtime.nnodes (torchrun: --nnodes) and a new runtime.rdzv_id"
        )


def _as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def seal(key: bytes, what: str, context: str, value: bytes) -> bytes:
    """`value` with its MAC in front."""
    return secret.mac(key, what.encode(), context.encode(), value) + value


def unseal(key: bytes, what: str, context: str, sealed: bytes, where: str) -> bytes:
    """The value of a sealed one; UnauthenticatedWrite (logged once) when its MAC fails."""
    tag, value = sealed[:TAG], sealed[TAG:]
    if len(sealed) < TAG or not secret.valid(key, tag, what.encode(), context.encode(), value):
        err = UnauthenticatedWrite(where, what, context.split("/")[0])
        log.error("%s", err)
        raise err
    return value


class MacStore:
    """The store the rendezvous hands the agent (MASTER_ADDR/PORT, the rank assignment, the
    exit barrier): what it sets is sealed, what it gets is opened. Counters (`add`) and
    waits pass through: they carry no value anyone acts on beyond a barrier's release."""

    def __init__(self, inner: Any, key: bytes, context: str, where: str) -> None:
        self._inner, self._mac_key, self._context, self._where = inner, key, context, where

    def _seal(self, k: str, v: Any) -> bytes:
        return seal(self._mac_key, f"store key {k}", self._context, _as_bytes(v))

    def _open(self, k: str, v: bytes) -> bytes:
        return unseal(self._mac_key, f"store key {k}", self._context, v, self._where)

    def set(self, k: str, v: Any) -> None:
        self._inner.set(k, self._seal(k, v))

    def get(self, k: str) -> bytes:
        return self._open(k, self._inner.get(k))

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._inner.multi_set(keys, [self._seal(k, v) for k, v in zip(keys, values, strict=True)])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self._open(k, v) for k, v in zip(keys, self._inner.multi_get(keys), strict=True)]

    def add(self, k: str, n: int) -> int:
        return int(self._inner.add(k, n))

    def wait(self, keys: list[str], *timeout: _dt.timedelta) -> None:
        self._inner.wait(keys, *timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check(keys))

    def delete_key(self, k: str) -> bool:
        return bool(self._inner.delete_key(k))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    @property
    def timeout(self) -> _dt.timedelta:
        return self._inner.timeout

    def set_timeout(self, timeout: _dt.timedelta) -> None:
        self._inner.set_timeout(timeout)
