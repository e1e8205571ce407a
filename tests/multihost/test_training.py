"""Training across two real hosts (tests/fixtures/hosts.py), started the ways clusters start it:
docs/scale-out.md's `enn distributed-train` on every node, and `torchrun -m flows.worker` with
this project's rendezvous backend. Every job is compared with the same job on one host with
the same world size (bit-identical weights), and every socket it listens on is read with `ss`
inside each host."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time

import psutil
import pytest

from enn_core.train.ckpt import COMMITTED, committed
from tests.fixtures.multihost import (
    STAGE,
    Job,
    enn_multinode,
    foreign_listeners,
    published_model,
    same_weights,
    stage_result,
    torchrun_multinode,
)

pytestmark = pytest.mark.timeout(600)


def _newer_model(hosts, since: float):
    fresh = [h for h in hosts if (h.checkout / "outputs" / STAGE / "model.pt").exists()]
    return [
        h for h in fresh if (h.checkout / "outputs" / STAGE / "model.pt").stat().st_mtime > since
    ]


def _ranks_sharded(ckpt_root) -> list[set[str]]:
    (digest,) = [d for d in ckpt_root.iterdir() if d.is_dir()]
    steps = committed(digest)
    assert steps and all((s / COMMITTED).exists() for s in steps)
    return [{p.name for p in s.glob("*.distcp")} for s in steps]


def _check_listeners(hosts, say, when: str) -> None:
    for h in hosts:
        listening = h.listening()
        say(f"{when}: {h.name} listens on {', '.join(map(str, listening)) or 'nothing'}")
        assert not foreign_listeners(h), f"{h.name} listens beyond {h.addr}/loopback: {listening}"


def test_two_hosts_train_like_one_host(testbed, reference, say, tmp_path):
    node1, node2 = testbed.hosts[:2]
    ckpt = testbed.shared / "ckpt-two-hosts"
    cmd = enn_multinode(
        f"{node1.name}:{testbed.bed.port(10)}",
        "job-two-hosts",
        ckpt,
        # a short pause at step 3 on one rank: time to read the sockets mid-training
        "fault.kind=delay",
        "fault.phase=step",
        "fault.step=3",
        "fault.seconds=5",
    )
    job = Job.start([node1, node2], cmd, tmp_path, "two-hosts")
    job.wait_for_beat(lambda r, b: b["phase"] != "done" and (b.get("step") or -1) >= 3)
    _check_listeners([node1, node2], say, "two hosts, after step 3")
    crossing = node2.run("ss", "-tnH", "state", "established").stdout
    assert node1.addr in crossing, crossing  # the collectives' connections cross the network
    codes = job.wait()
    wall = time.time() - job.started
    assert codes == [0, 0], job.output()
    say(f"two hosts, world size 2: {wall:.1f} s (one host: {reference[1]:.1f} s)")
    # global rank 0's node publishes; node2 publishes the same model.pt from the shared folder
    assert _newer_model([node1, node2], job.started) == [node1, node2]
    rank0 = node1
    assert not same_weights(published_model(rank0), reference[0])  # bit-identical
    assert (node1.checkout / "outputs" / STAGE / "model.pt").read_bytes() == (
        node2.checkout / "outputs" / STAGE / "model.pt"
    ).read_bytes()
    assert all(names == {"__0_0.distcp", "__1_0.distcp"} for names in _ranks_sharded(ckpt))
    events = [
        json.loads(line)
        for p in (rank0.checkout / "work" / "runs").glob(f"*/{STAGE}/events.jsonl")
        if p.stat().st_mtime >= job.started
        for line in p.read_text().splitlines()
    ]
    ifname = [e["value"] for e in events if e.get("name") == "resolved.runtime.socket_ifname"]
    assert ifname == ["eth0"], ifname  # gloo on the interface that holds the host's address
    other = node2 if rank0 is node1 else node1
    other_log = job.logs[[node1, node2].index(other)].read_text()
    assert "this node ran ranks [1]; the node of global rank 0 publishes the outputs" in other_log
    # rank 0 alone publishes (issue 38.3): the other node writes under outputs/ nothing of its
    # own, only rank 0's published files, byte for byte (issue 40.4: the model reaches every
    # node by itself); no params.json, metrics or plots of its own
    written = {
        str(p.relative_to(other.checkout))
        for p in (other.checkout / "outputs").rglob("*")
        if p.is_file() and p.stat().st_mtime >= job.started - 1
    }
    copies = {f"outputs/{STAGE}/{f}" for f in ("model.pt", "record.json", "history.json")}
    for name in written & copies:  # the model byte for byte; the records as the same JSON
        theirs, ours = (other.checkout / name).read_bytes(), (rank0.checkout / name).read_bytes()
        if name.endswith(".json"):  # rank 0's stage adds what its launcher saw (restarts)
            theirs, ours = json.loads(theirs), json.loads(ours)
            if isinstance(theirs, dict) and isinstance(ours, dict):
                ours = {k: ours.get(k) for k in theirs}
        assert theirs == ours, f"{other.name} wrote {name} of its own"
    # metrics.json: derived from the copied record.json, nothing else
    assert written <= copies | {f"outputs/{STAGE}/metrics.json"}, written


@pytest.mark.parametrize("launcher", ["enn", "torchrun"])
def test_a_worker_killed_on_host2_restarts_the_job_from_its_last_checkpoint(
    testbed, reference, say, tmp_path, launcher
):
    """SIGKILL of node2's worker mid-epoch (epoch 2, step 2 of 5): both hosts restart, the
    job resumes from the newest committed checkpoint and ends as the uninterrupted job did."""
    node1, node2 = testbed.hosts[:2]
    ckpt = testbed.shared / f"ckpt-killed-{launcher}"
    pause = [  # rank 1 pauses at step 7, twice: killed in the first, `ss` in the second
        "fault.kind=delay",
        "fault.phase=step",
        "fault.step=7",
        "fault.rank=1",
        "fault.times=2",
        "fault.seconds=10",
        f"fault.marker_dir={testbed.shared / f'faults-{launcher}'}",
    ]
    endpoint, job_id = f"{node1.name}:{testbed.bed.port(11 + len(launcher))}", f"job-{launcher}"
    if launcher == "enn":
        cmd = enn_multinode(endpoint, job_id, ckpt, *pause)
    else:
        cmd = torchrun_multinode(endpoint, job_id, ckpt, "runtime.socket_ifname=eth0", *pause)
    job = Job.start([node1, node2], cmd, tmp_path, launcher)
    beats = job.wait_for_beat(lambda r, b: r == 0 or (b["phase"] == "step" and b["step"] == 7))
    victim, beat = beats[1]
    assert victim is node2, "the rendezvous orders the nodes by name: node2 holds rank 1"
    newest = committed(next(d for d in ckpt.iterdir() if d.is_dir()))[-1].name
    _check_listeners([node1, node2], say, f"{launcher}, before the kill")
    first = {r: b["pid"] for r, (_, b) in beats.items()}
    node2.kill(int(beat["pid"]))  # by the pid node2 knows it by
    # both hosts start new workers; rank 1 pauses at step 7 again (the fault's second time)
    job.wait_for_beat(
        lambda r, b: b["pid"] != first[r] and (r == 0 or (b["phase"], b["step"]) == ("step", 7))
    )
    _check_listeners([node1, node2], say, f"{launcher}, after the restart")
    codes = job.wait()
    assert codes == [0, 0], job.output()
    beats = job.heartbeats()
    assert all(b["pid"] != first[r] for r, (_, b) in beats.items()), beats  # both restarted
    assert {r: h.name for r, (h, _) in beats.items()} == {0: node1.name, 1: node2.name}
    assert _newer_model([node1, node2], job.started) == [node1, node2]
    rank0 = node1
    result = stage_result(rank0, job.started)
    assert result["checkpoint"]["resumed_from"].endswith(newest), (newest, result)
    assert not same_weights(published_model(rank0), reference[0])  # as if never killed
    say(f"{launcher}: node2's worker killed at step 7 resumed from {newest}, weights bit-identical")


def test_a_node_whose_peer_goes_silent_stops_its_workers_under_enn(testbed, say, tmp_path):
    """Under enn's launcher (deploy/slurm's `srun ... enn run` path: the workers are
    `python -m enn_core.runtime.entry`), node2's agent and worker are frozen (SIGSTOP: no beat,
    no connection reset) while node1's rank 0 waits for rank 1 in the final checkpoint's
    collectives, a phase whose budget (runtime.checkpoint_budget_s) the watchdog would wait
    out. node1 names node2 within the liveness timeout (runtime.hang_timeout_s=15) and kills
    its worker, so its `enn` ends instead of waiting minutes for the collective's timeout,
    with one line naming node2."""
    node1, node2 = testbed.hosts[:2]
    faults = testbed.shared / "faults-silent-peer"
    cmd = enn_multinode(
        f"{node1.name}:{testbed.bed.port(60)}",
        "job-silent-peer",
        testbed.shared / "ckpt-silent-peer",
        "runtime.max_restarts=0",
        "runtime.hang_timeout_s=15",
        "runtime.checkpoint_budget_s=300",
        # rank 1 (node2) pauses in the final checkpoint phase: rank 0 then waits for it there
        "fault.kind=delay",
        "fault.phase=checkpoint",
        "fault.rank=1",
        "fault.seconds=300",
        f"fault.marker_dir={faults}",
    )
    job = Job.start([node1, node2], cmd, tmp_path, "silent-peer")
    frozen: list[psutil.Process] = []
    try:
        beats = job.wait_for_beat(lambda r, b: b["phase"] == "checkpoint" and b["step"] is None)
        assert (faults / "fault-delay-checkpoint-0").exists(), job.output()
        worker = int(beats[0][1]["pid"])  # rank 0's, as node1 knows it
        assert beats[0][0] is node1 and beats[1][0] is node2
        agent = psutil.Process(job.procs[1].pid)  # node2's nsenter, enn, torchrun and worker
        frozen = [agent, *agent.children(recursive=True)]
        for proc in frozen:
            proc.send_signal(signal.SIGSTOP)
        stopped = time.time()
        while _runs(node1, worker) and time.time() - stopped < 60:
            time.sleep(0.5)
        gone_after = time.time() - stopped
        assert not _runs(node1, worker), f"node1's worker still runs:\n{job.output()}"
        assert gone_after < 45, gone_after  # the 15 s timeout and a few beats
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.procs[0].wait(timeout=60)
        assert job.procs[0].returncode not in (None, 0), job.output()
        # enn's one line names node2 (not a crash of rank 0, nor the kernel's OOM killer)
        line = "node node2 (node rank 1, global ranks 1) went silent: no liveness beat for"
        console = job.logs[0].read_text()
        assert line in console and "watchdog:" not in console, job.output()
        assert "stopped this node's workers (pids" in _torchrun_log(node1, job.started)
        say(f"enn: node1 named node2 silent and its worker ended {gone_after:.0f} s after the stop")
    finally:
        for proc in frozen:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        job.wait(timeout=30)


def _runs(host, pid: int) -> bool:
    """Whether `pid` (the host's own numbering) is a live process of `host`."""
    state = host.run("ps", "-o", "stat=", "-p", str(pid), check=False).stdout.strip()
    return bool(state) and not state.startswith("Z")


def _torchrun_log(host, since: float) -> str:
    """The newest torchrun.log of the stage on `host` written after `since`."""
    logs = [
        p
        for p in (host.checkout / "work" / "runs").glob(f"*/{STAGE}/logs/torchrun.log")
        if p.stat().st_mtime >= since - 1
    ]
    return max(logs, key=lambda p: p.stat().st_mtime).read_text() if logs else ""
