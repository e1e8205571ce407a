"""The documented multi-node command, run on loopback: two `enn distributed-train` processes,
each in its own project copy (its own work directory, lock and MLflow store, as on two
machines), join one rendezvous and share one checkpoint directory (`checkpoint.dir`)."""

from __future__ import annotations

import subprocess

import pytest
import torch

from enn_core.runtime.launch import free_port
from enn_core.train.ckpt import COMMITTED, committed
from tests.fixtures.project import make_project

pytestmark = pytest.mark.timeout(900)
STAGES = ("stage-data", "prepare-checkpoint", "distributed-train")


def test_two_nodes_run_one_training_job_with_shared_checkpoints(tmp_path, prefect_home_shared):
    nodes = [
        make_project(tmp_path / f"node{i}", prefect_home_shared, stages=STAGES) for i in (0, 1)
    ]
    for node in nodes:  # the same staged data and initial checkpoint on every machine
        node.run("enn", "stage-data")
        node.run("enn", "prepare-checkpoint")
    shared = tmp_path / "shared-checkpoints"
    args = [
        "enn",
        "distributed-train",
        "--set",
        "runtime.nnodes=2",
        "--set",
        "runtime.world_size=1",
        "--set",
        f"runtime.rdzv_endpoint=127.0.0.1:{free_port()}",
        "--set",
        "runtime.rdzv_id=test-job-1",
        "--set",
        "runtime.local_addr=127.0.0.1",
        "--set",
        f"checkpoint.dir={shared}",
        "--set",
        "train.epochs=2",
        "--set",
        "checkpoint.every_steps=4",
    ]
    procs = [
        subprocess.Popen(
            args,
            cwd=n.root,
            env=n.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for n in nodes
    ]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(o[-3000:] for o in outs)
    models = [n.root / "outputs" / "distributed-train" / "model.pt" for n in nodes]
    assert sum(m.exists() for m in models) == 1, "exactly the node of global rank 0 writes model.pt"
    state = torch.load(next(m for m in models if m.exists()), weights_only=True)
    assert state["meta"]["world_size"] == 2
    (fp_dir,) = [d for d in shared.iterdir() if d.is_dir()]
    steps = committed(fp_dir)
    assert steps and all((s / COMMITTED).exists() for s in steps)
    for step in steps:  # both ranks' shards in one committed directory
        assert {p.name for p in step.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
