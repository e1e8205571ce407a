"""Which network interface a worker's collectives use, decided once per worker.

    choice = choose_interface(requested="", local_addr="node1", nnodes=2)
    choice.apply()          # GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, before the process group

gloo (and NCCL) pick the interface of the address the hostname resolves to unless
GLOO_SOCKET_IFNAME names one (FIELD_NOTES). On a cluster that is where jobs break first: a
hostname that resolves to 127.0.1.1 (Debian's default hosts file) makes every node offer a
loopback address to the others, and a host with several interfaces may answer from one the
others cannot reach. The choice, in order:

1. `runtime.socket_ifname` when set (it must exist on this host);
2. GLOO_SOCKET_IFNAME already in the environment (a cluster's own setting);
3. one node: loopback, so a one-machine job listens on nothing else;
4. several nodes: the interface that holds `runtime.local_addr`, else the one that holds the
   address the hostname resolves to; a loopback answer is refused with the fix.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

import psutil

from enn_core.errors import ConfigError

GLOO = "GLOO_SOCKET_IFNAME"
NCCL = "NCCL_SOCKET_IFNAME"


@dataclass(frozen=True)
class InterfaceChoice:
    """The collectives' interface (None: the library's own choice) and why."""

    name: str | None
    reason: str

    def apply(self) -> None:
        """Set the variables gloo and NCCL read when the process group is created."""
        if self.name is not None:
            os.environ[GLOO] = self.name
            os.environ.setdefault(NCCL, self.name)

    def as_record(self) -> dict[str, str]:
        return {"socket_ifname": self.name or "default", "socket_ifname_reason": self.reason}


def interfaces() -> dict[str, list[str]]:
    """This host's interfaces and their IPv4/IPv6 addresses."""
    kinds = (socket.AF_INET, socket.AF_INET6)
    return {
        name: [a.address.split("%")[0] for a in addrs if a.family in kinds]
        for name, addrs in psutil.net_if_addrs().items()
    }


def resolve(host: str) -> list[str]:
    """The addresses `host` (a name or an address) resolves to here."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(
            f"cannot resolve {host!r} on this host ({e}); set runtime.local_addr to an address "
            "of this host that the other nodes reach"
        ) from None
    return list(dict.fromkeys(str(i[4][0]) for i in infos))


def holding(addresses: list[str]) -> str | None:
    """The interface that holds one of `addresses`, if any."""
    for name, addrs in interfaces().items():
        if any(a in addrs for a in addresses):
            return name
    return None


def _loopback() -> str | None:
    return next((n for n, a in interfaces().items() if "127.0.0.1" in a), None)


def choose_interface(requested: str, local_addr: str, nnodes: int) -> InterfaceChoice:
    """The interface of this worker's collectives (see the module docstring for the order)."""
    if requested:
        known = interfaces()
        if requested not in known:
            raise ConfigError(
                f"runtime.socket_ifname={requested!r}: this host has no such interface "
                f"(it has {', '.join(sorted(known))}); name one of them or leave it empty"
            )
        return InterfaceChoice(requested, "runtime.socket_ifname")
    if os.environ.get(GLOO):
        return InterfaceChoice(os.environ[GLOO], f"{GLOO} from the environment")
    if nnodes == 1:
        lo = _loopback()
        return InterfaceChoice(lo, "one node: collectives stay on loopback")
    host = local_addr or socket.gethostname()
    key = "runtime.local_addr" if local_addr else "the hostname"
    addrs = resolve(host)
    if all(ipaddress.ip_address(a).is_loopback for a in addrs):
        raise ConfigError(
            f"{key} {host!r} resolves to {', '.join(addrs)} (loopback), which the other nodes "
            "cannot reach; set runtime.local_addr to this host's cluster address or "
            "runtime.socket_ifname to its interface"
        )
    name = holding(addrs)
    if name is None:
        raise ConfigError(
            f"{key} {host!r} resolves to {', '.join(addrs)}, which no interface of this host "
            f"holds ({', '.join(sorted(interfaces()))}); set runtime.local_addr to one of this "
            "host's addresses or runtime.socket_ifname to an interface"
        )
    return InterfaceChoice(name, f"holds {addrs[0]}, the address of {key} {host!r}")
