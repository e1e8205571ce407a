"""Network guard for the offline test: loaded by every Python process started with this
directory on PYTHONPATH (the flow, the temporary Prefect server, workers, dvc, `enn` stages).

It writes `watched-<pid>.json` (proof that the process was watched) into $ENN_NETGUARD_DIR and
refuses, and records in `violation-<pid>-<n>.json`, any connection or DNS lookup to a
non-loopback address.
"""

import ipaddress
import json
import os
import socket
import sys
import traceback

_DIR = os.environ.get("ENN_NETGUARD_DIR")
# The machine's own name resolves locally (/etc/hosts); torch's elastic agent looks it up.
_LOOPBACK_NAMES = {
    "localhost",
    "localhost.localdomain",
    "ip6-localhost",
    "ip6-loopback",
    socket.gethostname().lower(),
}
_count = [0]


def _record(kind, target):
    _count[0] += 1
    path = os.path.join(_DIR, f"violation-{os.getpid()}-{_count[0]}.json")
    with open(path, "w") as f:
        json.dump(
            {
                "pid": os.getpid(),
                "argv": sys.argv,
                "kind": kind,
                "target": repr(target),
                "stack": traceback.format_stack(limit=12),
            },
            f,
        )


def _is_loopback_host(host):
    if host is None or host == "":
        return True
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    host = str(host).strip("[]").split("%")[0]
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    return addr.is_loopback or addr.is_unspecified


def _check_address(kind, family, address):
    if family == getattr(socket, "AF_UNIX", None) or not isinstance(address, tuple):
        return
    if not _is_loopback_host(address[0]):
        _record(kind, address)
        raise OSError(f"netguard: {kind} to non-loopback address {address!r} refused")


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    with open(os.path.join(_DIR, f"watched-{os.getpid()}.json"), "w") as f:
        json.dump(
            {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "exe": sys.executable}, f
        )

    _connect, _connect_ex, _sendto = (
        socket.socket.connect,
        socket.socket.connect_ex,
        socket.socket.sendto,
    )
    _getaddrinfo, _gethostbyname = socket.getaddrinfo, socket.gethostbyname

    def connect(self, address):
        _check_address("connect", self.family, address)
        return _connect(self, address)

    def connect_ex(self, address):
        _check_address("connect", self.family, address)
        return _connect_ex(self, address)

    def sendto(self, data, *args):
        _check_address("sendto", self.family, args[-1])
        return _sendto(self, data, *args)

    def getaddrinfo(host, *args, **kwargs):
        if not _is_loopback_host(host):
            _record("dns", host)
            raise socket.gaierror(socket.EAI_NONAME, f"netguard: DNS lookup of {host!r} refused")
        return _getaddrinfo(host, *args, **kwargs)

    def gethostbyname(host):
        if not _is_loopback_host(host):
            _record("dns", host)
            raise socket.gaierror(socket.EAI_NONAME, f"netguard: DNS lookup of {host!r} refused")
        return _gethostbyname(host)

    socket.socket.connect, socket.socket.connect_ex, socket.socket.sendto = (
        connect,
        connect_ex,
        sendto,
    )
    socket.getaddrinfo, socket.gethostbyname = getaddrinfo, gethostbyname
