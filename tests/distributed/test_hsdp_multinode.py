"""Scale-out oracles: HSDP on a 2 x 2 mesh trains like FSDP on 4 ranks, and one job spread
over two elastic agents (two "nodes" on loopback) trains like the same job on one node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from dist_fixtures import alive, cfg_of, outputs, run_train
from hsdp_worker import main_each, write_job

from enn_core.config import load_config
from enn_core.data.dataset import StagedDataset
from enn_core.errors import ConfigError, TransientError
from enn_core.runtime.dist import mesh_layout
from enn_core.runtime.heartbeat import heartbeat_path, read_heartbeats
from enn_core.runtime.launch import Rendezvous, Watchdog, free_port, launch
from enn_core.stage import make_context
from enn_core.train.ckpt import committed
from enn_core.train.fingerprint import fingerprint
from enn_core.train.stage import checkpoint_spec

# Four ranks, one thread each, tiny shapes; two epochs of 5 steps, every one clipped (the
# grad norm must count each shard once, not once per replica).
HSDP = ("runtime.world_size=4", "train.batch_size=8", "train.clip_norm=0.05")


def _events(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def _result(result_dir) -> tuple[dict, dict]:
    history = json.loads((result_dir / "history.json").read_text())
    return history, torch.load(result_dir / "model.pt", weights_only=True)["state_dict"]


def _checkpoint_spec(layout, cfg) -> dict:
    """distributed-train's DCP checkpoint directory for this config (fresh: nothing to resume)."""
    ctx = make_context(cfg, layout, "distributed-train", uuid.uuid4().hex[:8])
    data_hash = StagedDataset(layout.output("stage-data")).fingerprint
    return checkpoint_spec(cfg, ctx, fingerprint(cfg, data_hash))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_hsdp_2x2_equals_fsdp_on_4(tiny_project, tmp_path):
    run_dir = tmp_path / "run"
    jobs, specs = [], []
    for name, extra in (("fsdp", ()), ("hsdp", ("train.hsdp_replicas=2",))):
        cfg = cfg_of(*HSDP, *extra)
        specs.append(_checkpoint_spec(tiny_project, cfg))  # DCP saves at epoch ends
        jobs.append(write_job(tiny_project, cfg, run_dir, run_dir / name, name, specs[-1]))
    # FSDP on 4, then HSDP 2 x 2, in the same 4 workers (one spawn)
    results = launch(main_each, tuple(map(str, jobs)), nprocs=4, run_dir=run_dir, hang_timeout_s=60)
    fsdp, hsdp = results[0]
    assert (fsdp["wrap"], hsdp["wrap"]) == ("fsdp2", "hsdp")
    meshes = [e["value"] for e in _events(run_dir) if e.get("name") == "runtime/mesh"]
    assert meshes == ["4", "2x2"]
    # DCP saved the 2-D-sharded state at both epoch ends
    assert len(hsdp["checkpoint"]["saved_positions"]) == 2 and committed(Path(specs[1]["dir"]))
    ref_history, ref_state = _result(run_dir / "fsdp")
    history, state = _result(run_dir / "hsdp")
    assert len(history["step_losses"]) >= 10
    torch.testing.assert_close(
        torch.tensor(history["step_losses"]), torch.tensor(ref_history["step_losses"]),
        rtol=1e-5, atol=0,
    )  # fmt: skip
    assert state.keys() == ref_state.keys()
    # part 1's tolerance: the attention key bias has a zero true gradient, and Adam turns
    # the summation-order noise of that gradient into lr-sized steps (~7e-6 here; 1e-7 elsewhere)
    for name, p in ref_state.items():
        torch.testing.assert_close(state[name], p, rtol=1e-4, atol=1e-5)


def test_hsdp_mesh_layout_and_its_errors():
    assert mesh_layout(4, 1) == ((4,), ("shard",))
    assert mesh_layout(4, 2) == ((2, 2), ("replicate", "shard"))
    with pytest.raises(
        ConfigError,
        match=r"hsdp_replicas=3 does not divide runtime.world_size=4; pick one of \[1, 2, 4\]",
    ):
        mesh_layout(4, 3)
    with pytest.raises(ConfigError, match="must be >= 1"):
        mesh_layout(4, 0)


AGENT = Path(__file__).with_name("multinode_agent.py")


def _start_agent(job: Path, run_dir: Path, endpoint: str, rdzv_id: str, restarts: int):
    args = [sys.executable, str(AGENT), str(job), str(run_dir), endpoint, rdzv_id, "2", "1",
            str(restarts)]  # fmt: skip
    with open(run_dir / "agent.out", "w") as log:  # its own session: killpg ends its workers
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


KILL_RANK_1 = ("fault.kind=kill", "fault.phase=step", "fault.step=3", "fault.rank=1")


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", [(), KILL_RANK_1], ids=["clean", "rank1-killed-restarted"])
def test_two_agents_on_loopback_equal_one_node_with_two_workers(tiny_project, tmp_path, fault):
    """Two nodes of one worker each against one node of two (run at the same time). With
    `fault`, node 1's worker is SIGKILLed at step 3 and both agents restart the group (no
    checkpoints here: training starts over), across nodes that may count restarts apart."""
    cfg = cfg_of()  # runtime.world_size=2 on one node; 1 worker per node on two
    endpoint, rdzv_id = f"127.0.0.1:{free_port()}", f"job-{uuid.uuid4().hex[:8]}"
    nodes = [tmp_path / "node-a", tmp_path / "node-b"]
    # one marker dir for both nodes: the fault fires once even if rank 1 changed node
    shared = (f"fault.marker_dir={tmp_path / 'faults'}",) if fault else ()
    jobs = [write_job(tiny_project, cfg_of(*fault, *shared), d, d / "result") for d in nodes]
    restarts = 1 if fault else 0
    agents = [
        _start_agent(j, d, endpoint, rdzv_id, restarts) for j, d in zip(jobs, nodes, strict=True)
    ]
    try:
        run_train(tiny_project, cfg)  # the one-node reference, while the agents run
        ref_history, ref_state = outputs(tiny_project)
        codes = [a.wait(timeout=200) for a in agents]
    finally:
        for a in agents:  # nothing may outlive the test, whatever happened
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    reports = [json.loads((d / "agent.json").read_text()) for d in nodes]
    assert codes == [0, 0], reports
    # the rendezvous gave each node one of the global ranks; only rank 0's node has model.pt
    ranks = sorted(int(r) for rep in reports for r in rep["ranks"])
    assert ranks == [0, 1] and all(len(rep["ranks"]) == 1 for rep in reports)
    main = next(d for d, rep in zip(nodes, reports, strict=True) if "0" in rep["ranks"])
    other = next(d for d in nodes if d != main)
    assert not (other / "result" / "model.pt").exists()
    history, state = _result(main / "result")
    assert history["step_losses"] == ref_history["step_losses"]  # bit-identical
    assert state.keys() == ref_state.keys()
    assert all(torch.equal(state[k], v) for k, v in ref_state.items())
    beats = {**read_heartbeats(nodes[0]), **read_heartbeats(nodes[1])}
    # the killed node counts a restart; the other may not (a membership change is not one)
    assert beats[1]["attempt"] == restarts and beats[1]["phase"] == "done"
    pids = [int(h["pid"]) for h in beats.values()]
    deadline = time.time() + 10
    while alive(pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not alive(pids)


def _beat(run_dir: Path, rank: int, age: float, phase: str = "step") -> None:
    path = heartbeat_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    now = time.time()
    path.write_text(json.dumps({"rank": rank, "pid": 1, "phase": phase, "step": 3, "frame": "x.py:1 in f",
                                "progress_time": now - age, "beat_time": now, "in_collective": False}))  # fmt: skip


def test_watchdog_of_a_node_that_owns_global_ranks_2_and_3(tmp_path):
    w = Watchdog(
        tmp_path, 2, hang_timeout_s=1, budgets={"spawn": 1}, local_only=True, rendezvous_s=5
    )
    _beat(tmp_path, 3, age=0)
    assert w.check(time.time() - 6) is None  # still inside the rendezvous wait
    v = w.check(time.time() - 8)  # rank 2 never beat: this node cannot name it
    assert v.rank is None and v.phase == "spawn" and "seen: ranks [3]" in v.frame
    assert v.message(tmp_path).startswith("a worker of this node hung in phase spawn")
    _beat(tmp_path, 2, age=5)  # both beat; rank 2 then went silent outside a collective
    v = w.check(time.time())
    assert (v.rank, v.phase, v.step) == (2, "step", 3)


def test_multi_node_config_needs_endpoint_and_id():
    ok = ["runtime.nnodes=2", "runtime.rdzv_endpoint=node0:29400", "runtime.rdzv_id=job42"]
    rt = load_config(None, ok).runtime
    assert Rendezvous.of(rt) == Rendezvous(nnodes=2, endpoint="node0:29400", run_id="job42",
                                           timeout_s=rt.rdzv_timeout_s)  # fmt: skip
    with pytest.raises(ConfigError, match="runtime.nnodes=2 needs runtime.rdzv_endpoint"):
        load_config(None, ok[:2])
    with pytest.raises(ConfigError, match="is not host:port"):
        load_config(None, ["runtime.rdzv_endpoint=node0"])
    with pytest.raises(ConfigError, match="needs runtime.rdzv_endpoint"):
        Rendezvous(nnodes=3)


def _never_runs() -> None:
    raise AssertionError("no worker starts without the other node")


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_node_whose_peer_never_joins_gets_a_transient_rendezvous_error(tmp_path):
    rdzv = Rendezvous(nnodes=2, endpoint=f"127.0.0.1:{free_port()}", run_id="lonely", timeout_s=3)
    with pytest.raises(TransientError, match="rendezvous lonely at 127.0.0.1:.*start all 2 nodes"):
        launch(_never_runs, (), nprocs=1, run_dir=tmp_path, hang_timeout_s=10, rdzv=rdzv)
