"""Scale-out oracles on one machine: HSDP on a 2 x 2 mesh trains like FSDP on 4 ranks; a node
whose peer never joins gets a transient rendezvous error; the shared-directory check names the
rank on another disk. Jobs across real hosts (and a worker killed on one of them) are the
multi-host tier's (tests/multihost/test_training.py)."""

from __future__ import annotations

import json
import logging
import uuid

import pytest
import torch

from enn_core.data.dataset import StagedDataset
from enn_core.errors import TransientError
from enn_core.runtime import secret
from enn_core.runtime.launch import Rendezvous, free_port, launch
from enn_core.stage import make_context
from enn_core.stages import DISTRIBUTED_TRAIN, STAGE_DATA
from enn_core.train.ckpt import committed
from enn_core.train.fingerprint import fingerprint
from enn_core.train.job import CheckpointPlan
from enn_core.train.stage import checkpoint_spec
from tests.fixtures.distributed import cfg_of
from tests.fixtures.scaleout import main_each, probe_shared, write_job

# Four ranks, one thread each, tiny shapes; two epochs of 5 steps, every one clipped (the
# grad norm must count each shard once, not once per replica).
HSDP = ("runtime.world_size=4", "train.batch_size=8", "train.clip_norm=0.05")


def _events(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def _result(result_dir) -> tuple[dict, dict]:
    history = json.loads((result_dir / "history.json").read_text())
    return history, torch.load(result_dir / "model.pt", weights_only=True)["state_dict"]


def _checkpoint_spec(layout, cfg) -> CheckpointPlan:
    """distributed-train's DCP checkpoint directory for this config (fresh: nothing to resume)."""
    ctx = make_context(cfg, layout, DISTRIBUTED_TRAIN, uuid.uuid4().hex[:8])
    data_hash = StagedDataset(STAGE_DATA.output_dir(layout)).fingerprint
    return checkpoint_spec(cfg, ctx, fingerprint(cfg, data_hash))


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
    meshes = [e["value"] for e in _events(run_dir) if e.get("name") == "resolved.runtime.mesh"]
    assert meshes == ["4", "2x2"]
    # DCP saved the 2-D-sharded state at both epoch ends
    assert len(hsdp["checkpoint"]["saved_positions"]) == 2 and committed(specs[1].dir)
    ref_history, ref_state = _result(run_dir / "fsdp")
    history, state = _result(run_dir / "hsdp")
    assert len(history["step_losses"]) >= 10
    torch.testing.assert_close(
        torch.tensor(history["step_losses"]),
        torch.tensor(ref_history["step_losses"]),
        rtol=1e-5,
        atol=0,
    )
    assert state.keys() == ref_state.keys()
    # part 1's tolerance: the attention key bias has a zero true gradient, and Adam turns
    # the summation-order noise of that gradient into lr-sized steps (~7e-6 here; 1e-7 elsewhere)
    for name, p in ref_state.items():
        torch.testing.assert_close(state[name], p, rtol=1e-4, atol=1e-5)


def _never_runs() -> None:
    raise AssertionError("no worker starts without the other node")


@pytest.mark.timeout(60)
def test_a_node_whose_peer_never_joins_gets_a_transient_rendezvous_error(tmp_path, monkeypatch):
    monkeypatch.setenv(secret.ENV, str(secret.make(tmp_path / "job-secret")))  # several nodes
    rdzv = Rendezvous(nnodes=2, endpoint=f"127.0.0.1:{free_port()}", run_id="lonely", timeout_s=3)
    with pytest.raises(TransientError, match="rendezvous lonely at 127.0.0.1:.*start all 2 nodes"):
        launch(_never_runs, (), nprocs=1, run_dir=tmp_path, hang_timeout_s=10, rdzv=rdzv)


@pytest.mark.timeout(90)
def test_a_node_waiting_for_its_peer_says_so_on_the_console_and_in_its_error(
    tmp_path, monkeypatch, caplog
):
    """torchrun's output goes to the log file; the rendezvous's "still waiting" line is the
    one the person at this node needs, and the timeout's error says whom it waited for
    (torchrun's own says only `RendezvousTimeoutError`)."""
    monkeypatch.setenv(secret.ENV, str(secret.make(tmp_path / "job-secret")))
    rdzv = Rendezvous(nnodes=2, endpoint=f"127.0.0.1:{free_port()}", run_id="alone", timeout_s=6)
    with (
        caplog.at_level(logging.WARNING, logger="enn.launch"),
        pytest.raises(TransientError) as err,
    ):
        launch(_never_runs, (), nprocs=1, run_dir=tmp_path, hang_timeout_s=10, rdzv=rdzv)
    said = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert said and "rendezvous alone at 127.0.0.1:" in said[-1], caplog.text
    assert "still waiting for 1 more node(s) of 2; seen: " in str(err.value)
    assert "no detail" not in str(err.value)


@pytest.mark.timeout(120)
def test_ranks_not_sharing_names_the_rank_on_another_disk(tmp_path):
    """Two ranks given different directories stand for two nodes with local disks."""
    shared, local = str(tmp_path / "shared"), str(tmp_path / "node1-local")
    for dirs, expected in (([shared, shared], []), ([shared, local], [1])):
        results = launch(
            probe_shared,
            (dirs,),
            nprocs=2,
            run_dir=tmp_path / f"run{len(expected)}",
            hang_timeout_s=60,
        )
        assert results[0] == results[1] == expected
    assert not list((tmp_path / "shared").iterdir())  # the probe is removed
