"""Across hosts, only the job's own members act (issue 38): a third host that reaches a running
job's rendezvous port and knows its id (it is on every node's command line) writes the
rendezvous state as a pickle that runs a command; the nodes check its HMAC with the job secret
(each host's own file, named by its environment; the third host has none to use) before torch
unpickles it, so nothing runs and the job stops with one line naming the store. The shared
folders choose nothing: a link planted there is followed by no node."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from enn_core.config import load_config
from enn_core.data.dataset import StagedDataset
from enn_core.train.ckpt import COMMITTED
from enn_core.train.fingerprint import fingerprint
from tests.fixtures.multihost import Job, enn_multinode, torchrun_multinode

pytestmark = pytest.mark.timeout(300)

# What the attacker runs on node3: a plain TCPStore client setting the job's state key to a
# pickle whose unpickling creates the marker file (any command would do).
ATTACK = """
import base64, datetime, pickle, sys
import torch.distributed as dist

class Payload:
    def __reduce__(self):
        return (open, (sys.argv[3], "w"))

host, port, marker, job = sys.argv[1:5]
store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=10))
store.set("torch.rendezvous." + job, base64.b64encode(pickle.dumps(Payload())).decode())
print("written")
"""


@pytest.mark.parametrize("launcher", ["enn", "torchrun"])
def test_a_third_host_writing_the_rendezvous_state_runs_nothing(testbed, say, tmp_path, launcher):
    node1, node2, node3 = testbed.hosts
    marker = testbed.shared / f"injected-{launcher}"
    port = testbed.bed.port(40 + len(launcher))
    endpoint, job_id = f"{node1.name}:{port}", f"job-inject-{launcher}"
    ckpt = testbed.shared / f"ckpt-inject-{launcher}"
    pause = ["fault.kind=delay", "fault.phase=step", "fault.step=2", "fault.seconds=20"]
    # its own count of fired faults: the checkout's work/faults holds earlier tests' (a delay at
    # a step fires once there), and without the pause the job could end before the attack
    pause.append(f"fault.marker_dir={testbed.shared / f'faults-inject-{launcher}'}")
    if launcher == "enn":
        cmd = enn_multinode(endpoint, job_id, ckpt, *pause)
    else:
        cmd = torchrun_multinode(endpoint, job_id, ckpt, "runtime.socket_ifname=eth0", *pause)
    job = Job.start([node1, node2], cmd, tmp_path, f"inject-{launcher}")
    job.wait_for_beat(lambda r, b: b["phase"] == "step" and (b.get("step") or 0) >= 2)
    attack = node3.run(sys.executable, "-c", ATTACK, node1.addr, str(port), str(marker), job_id)
    assert "written" in attack.stdout, attack
    codes = job.wait(timeout=120)
    out = job.output()
    assert not marker.exists(), f"the forged state was unpickled on a node:\n{out}"
    if codes != [0, 0]:  # the job ends (within seconds, job.wait's timeout) naming the store
        assert f"rendezvous store at {endpoint}" in out, out
        assert "unauthenticated write" in out, out
    say(f"{launcher}: the injected rendezvous state ran nothing; exits {codes}")


def _victim(shared: Path) -> Path:
    """A folder someone else owns, holding what looks like a committed checkpoint."""
    step = shared / "victim" / "step-00000004"
    step.mkdir(parents=True, exist_ok=True)
    (step / COMMITTED).write_text('{"files": {}}')
    (step / "keep.txt").write_text("precious")
    return step.parent


def _contents(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_links_planted_in_the_shared_folders_are_one_line_and_nothing_follows_them(
    testbed, tmp_path
):
    """The job's checkpoint fingerprint folder and the prediction parts folder, both in the
    shared folder, planted as links to someone else's folder: every node refuses in one line
    before any rank starts; the folder they point at is as it was."""
    node1, node2 = testbed.hosts[:2]
    victim = _victim(testbed.shared)
    before = _contents(victim)
    cfg = load_config(node1.checkout / "params.yaml")  # the job's data, model and train
    staged = StagedDataset(node1.checkout / "outputs" / "stage-data")
    ckpt = testbed.shared / "ckpt-linked"
    ckpt.mkdir()
    (ckpt / fingerprint(cfg, staged.fingerprint).digest).symlink_to(victim)
    endpoint = f"{node1.name}:{testbed.bed.port(50)}"
    job = Job.start([node1, node2], enn_multinode(endpoint, "job-linked", ckpt), tmp_path, "ck")
    assert job.wait(timeout=120) == [2, 2], job.output()
    assert all("is a link" in p.read_text() for p in job.logs), job.output()
    parts = testbed.shared / "parts-linked"
    parts.mkdir()
    (parts / "predict").symlink_to(victim)
    sets = [
        "predict.split=all",
        "runtime.nnodes=2",
        f"runtime.rdzv_endpoint={node1.name}:{testbed.bed.port(51)}",
        "runtime.rdzv_id=predict-linked",
        f"predict.parts_dir={parts}",
    ]
    cmd = ["enn", "predict", *(p for s in sets for p in ("--set", s))]
    job = Job.start([node1, node2], cmd, tmp_path, "parts")
    assert job.wait(timeout=120) == [2, 2], job.output()
    assert all("is a link" in p.read_text() for p in job.logs), job.output()
    assert _contents(victim) == before


def test_a_partitioned_node_is_named_by_the_other_within_the_liveness_timeout(testbed, tmp_path):
    """node2's network is cut mid-training (no connection is reset: a partition); node1 names
    node2 and its rank from the liveness beats within the timeout (torchrun's
    `--rdzv-conf liveness_timeout=`, what the launcher sets from runtime.hang_timeout_s),
    instead of each node naming its own rank as hung minutes later. Both nodes then end: node1
    at once; node2, cut off from the store, names it, and ends its agent a grace later (torch's
    agent stays blocked in a store call for minutes otherwise: seen, over 200 s). No worker of
    the job is left on either node."""
    node1, node2 = testbed.hosts[:2]
    endpoint = f"{node1.name}:{testbed.bed.port(52)}"
    cmd = torchrun_multinode(
        endpoint,
        "job-partition",
        testbed.shared / "ckpt-partition",
        "runtime.socket_ifname=eth0",
        "fault.kind=delay",
        "fault.phase=step",
        "fault.step=2",
        "fault.seconds=20",
        f"fault.marker_dir={testbed.shared / 'faults-partition'}",  # its own count (see above)
    )
    at = cmd.index("--max-restarts=1")
    cmd[at : at + 1] = ["--max-restarts=0", "--rdzv-conf=liveness_timeout=15"]
    job = Job.start([node1, node2], cmd, tmp_path, "partition")
    try:
        job.wait_for_beat(lambda r, b: b["phase"] == "step" and (b.get("step") or 0) >= 2)
        node2.run("ip", "link", "set", "eth0", "down")
        cut = time.time()
        line = "node node2 (node rank 1, global ranks 1) went silent: no liveness beat for"
        while line not in job.logs[0].read_text() and time.time() - cut < 60:
            time.sleep(0.5)
        named_after = time.time() - cut
        assert line in job.logs[0].read_text(), job.output()
        assert named_after < 45, named_after  # the 15 s timeout and a few beats
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.procs[0].wait(timeout=30)
        assert job.procs[0].returncode not in (None, 0), job.output()
        # node2, still cut off: it names the store, then ends its agent (15 s + the 30 s grace)
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.procs[1].wait(timeout=max(1.0, cut + 120 - time.time()))
        took = time.time() - cut
        own = job.logs[1].read_text()
        assert "the rendezvous store at" in own and "did not answer this node (node2)" in own, own
        assert "ending this node's agent (exit 1)" in own, own
        assert job.procs[1].returncode not in (None, 0), (took, job.output())
        left = [p.pid for p in psutil.process_iter(["cmdline"]) if _of_job(p, "ckpt-partition")]
        assert not left, f"workers of the cut job still run: {left}"
    finally:
        node2.run("ip", "link", "set", "eth0", "up")
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.wait(timeout=30)


def _of_job(proc: psutil.Process, name: str) -> bool:
    cmd = proc.info["cmdline"] or []
    return proc.info["cmdline"] is not None and any(name in c for c in cmd) and "-m" in cmd
