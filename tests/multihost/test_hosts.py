"""The test bed itself: each host is a machine of its own as far as code can tell (hostname,
addresses, processes, checkout), the hosts reach each other and nothing else, and the root
namespace gains nothing."""

from __future__ import annotations

import json
import subprocess
import time

from tests.fixtures.hosts import PREFIX

PROBE = """
import errno, json, os, socket, sys
import psutil
from enn_core.runtime.torch_private import names_this_machine
from enn_core.runtime.network import choose_interface
others = sys.argv[1].split(",")
s = socket.socket()
s.settimeout(3)
try:
    s.connect(("192.0.2.1", 80))  # TEST-NET-1: no route from a test host
    outside = "connected"
except OSError as e:
    outside = errno.errorcode.get(e.errno, str(e))
print(json.dumps({
    "hostname": socket.gethostname(),
    "own": socket.gethostbyname(socket.gethostname()),
    "others": {o: socket.gethostbyname(o) for o in others},
    "is_me": names_this_machine(socket.gethostname()),
    "others_are_me": [names_this_machine(o) for o in others],
    "gloo_interface": choose_interface("", "", 2).name,
    "pid": os.getpid(),
    "processes": len(psutil.pids()),
    "outside": outside,
}))
"""


def test_each_host_is_a_machine_of_its_own(testbed):
    hosts = testbed.hosts
    names = {h.name: h.addr for h in hosts}
    for h in hosts:
        others = [o for o in names if o != h.name]
        seen = json.loads(h.run("python", "-c", PROBE, ",".join(others)).stdout)
        assert seen["hostname"] == h.name and seen["own"] == h.addr
        assert seen["others"] == {o: names[o] for o in others}
        assert seen["is_me"] and not any(seen["others_are_me"])  # the rendezvous's check
        assert seen["gloo_interface"] == "eth0"  # the interface that holds the host's address
        assert seen["processes"] < 10 and seen["pid"] < 100  # its own PID namespace
        assert seen["outside"] in ("ENETUNREACH", "EHOSTUNREACH"), seen["outside"]


def test_each_host_has_its_own_checkout_at_one_path_and_shares_one_folder(testbed):
    h1, h2, _ = testbed.hosts
    assert h1.view == h2.view
    h1.run("sh", "-c", "echo node1 > written-on-node1")
    assert (h1.checkout / "written-on-node1").read_text() == "node1\n"
    assert not (h2.checkout / "written-on-node1").exists()
    assert h2.run("ls", "written-on-node1", check=False).returncode != 0
    assert not (testbed.bed.view / "written-on-node1").exists()
    (h1.checkout / "written-on-node1").unlink()
    h2.run("sh", "-c", f"echo from-node2 > {testbed.shared}/note")
    assert h1.run("cat", f"{testbed.shared}/note").stdout == "from-node2\n"


def test_the_root_namespace_gains_no_interface_or_address(testbed):
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()]
    assert not {"br0", *(f"p{i + 1}" for i in range(len(testbed.hosts)))} & set(names), names
    assert not any(h.addr in addrs for h in testbed.hosts)
    ours = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert all(h.netns in ours for h in testbed.hosts) and PREFIX in ours


def test_a_dead_sessions_leftovers_are_swept_and_a_live_ones_are_not(testbed, tmp_path):
    """What a tier killed on its time limit leaves (a namespace, a host process, a folder) is
    removed by the next session; the running session's hosts stay."""
    import psutil

    from tests.fixtures.hosts import owner_tag, sweep

    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = f"{PREFIX}-{gone.pid}-{int(time.time()) - 5}"  # its process no longer runs
    live = owner_tag(psutil.Process())
    subprocess.run(["ip", "netns", "add", f"{dead}-h1"], check=True)
    (tmp_path / dead).mkdir()
    (tmp_path / live).mkdir()
    removed = sweep(tmp_path)
    assert f"namespace {dead}-h1" in removed and f"folder {tmp_path / dead}" in removed
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{dead}-h1" not in listed
    assert all(h.netns in listed for h in testbed.hosts)  # this session's hosts are untouched
    assert (tmp_path / live).exists() and testbed.hosts[0].run("true").returncode == 0
