"""Prediction across two real hosts: `enn predict` (and the prediction flow) with the training
job's multi-node settings; each rank predicts its share of the parts into the shared folder,
global rank 0's node assembles. The output equals one host's (values and row order), and a
host killed mid-prediction is resumed from the parts already written."""

from __future__ import annotations

import hashlib
import json
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.fixtures.multihost import Job

pytestmark = pytest.mark.timeout(600)

ALL_ROWS = ["predict.split=all", "predict.chunk_rows=4"]  # 48 rows in 12 parts


def _sets(*overrides: str) -> list[str]:
    return [p for o in overrides for p in ("--set", o)]


def _multinode(testbed, job: str, *extra: str) -> list[str]:
    """docs/scale-out.md's prediction command for every node."""
    return [
        "runtime.nnodes=2",
        "runtime.world_size=1",
        f"runtime.rdzv_endpoint={testbed.hosts[0].name}:{testbed.bed.port(30)}",
        f"runtime.rdzv_id={job}",
        f"predict.parts_dir={testbed.shared / 'predict-parts'}",
        *extra,
    ]


def _outputs(host, pipeline: str = "") -> tuple[np.ndarray, list]:
    out = host.checkout / pipeline / "outputs" / "predict"
    keys = pq.read_table(out / "predictions.parquet").select(["month", "daytype", "direction"])
    return np.load(out / "predictions.npy"), keys.to_pylist()


def _last_summary(host) -> dict:
    runs = sorted(
        (host.checkout / "work" / "runs").glob("*/predict/result.json"),
        key=lambda p: p.stat().st_mtime,
    )
    return json.loads(runs[-1].read_text())


def test_a_prediction_across_hosts_equals_one_hosts_and_resumes_after_a_host_dies(
    testbed, say, tmp_path
):
    node1, node2 = testbed.hosts[:2]
    node1.run("enn", "predict", *_sets(*ALL_ROWS))
    reference, ref_keys = _outputs(node1)
    parts = testbed.shared / "predict-parts" / "predict"
    # rank 1 (node2: parts 6-11) pauses after part 7; then every process of node2 is killed
    pause = [
        "fault.kind=delay",
        "fault.phase=predict_chunk",
        "fault.step=7",
        "fault.rank=1",
        "fault.seconds=60",
        f"fault.marker_dir={testbed.shared / 'faults-predict'}",
    ]
    cmd = ["enn", "predict", *_sets(*ALL_ROWS, *_multinode(testbed, "predict-1", *pause))]
    job = Job.start([node1, node2], cmd, tmp_path, "predict-killed")
    end = time.time() + 240
    while not (parts / "part-00007.done").exists() and time.time() < end:
        assert all(p.poll() is None for p in job.procs), job.output()
        time.sleep(0.2)
    node2.run("sh", "-c", "kill -9 -1")  # every process of node2 but its init
    codes = job.wait()
    assert codes[0] != 0 and codes[1] != 0, job.output()  # node1's rank lost its peer
    say(f"node1 after node2 died: {job.logs[0].read_text().strip().splitlines()[-1]}")
    done = sorted(int(p.name[5:10]) for p in parts.glob("part-*.done"))
    assert done == [0, 1, 2, 3, 4, 5, 6, 7], done  # node1's share and node2's first two
    # someone without the job secret rewrites kept part 3 with other values and recomputes
    # its marker's sha256 (issue 38.2); a user leaves a file of theirs in the shared folder
    np.save(parts / "part-00003.npy", np.full_like(np.load(parts / "part-00003.npy"), 7.0))
    marker = json.loads((parts / "part-00003.done").read_text())
    marker["sha256"] = hashlib.sha256((parts / "part-00003.npy").read_bytes()).hexdigest()
    (parts / "part-00003.done").write_text(json.dumps(marker))
    (parts / "notes.txt").write_text("a user's file")

    again = ["enn", "predict", *_sets(*ALL_ROWS, *_multinode(testbed, "predict-2"))]
    job = Job.start([node1, node2], again, tmp_path, "predict-again")
    assert job.wait() == [0, 0], job.output()
    summary = _last_summary(node1)
    assert summary["nodes"] == 2 and summary["n_parts"] == 12
    node2_summary = _last_summary(node2)
    kept = [k for k in done if k != 3]
    assert sorted(summary["reused_parts"] + node2_summary["reused_parts"]) == kept
    assert sorted(summary["computed_parts"] + node2_summary["computed_parts"]) == [3, 8, 9, 10, 11]
    predictions, keys = _outputs(node1)
    assert np.array_equal(predictions, reference) and keys == ref_keys  # values and row order
    node2_out = node2.checkout / "outputs" / "predict" / "manifest.json"  # the template's
    assert node2_out.stat().st_mtime < job.started  # only global rank 0's node publishes
    # assembled: the parts are removed, the user's file is left (and named)
    assert sorted(p.name for p in parts.iterdir()) == [".enn-parts", "notes.txt"]  # enn's mark
    assert "notes.txt" in job.logs[0].read_text()
    say(f"prediction across hosts: resumed {len(kept)} parts, recomputed the forged one")


def test_the_prediction_flow_and_torchrun_take_the_same_settings(testbed, tmp_path):
    """`enn run --flow prediction` with the multi-node settings on both hosts (node2 stops after
    its share; node1 assembles and runs collapse-check), then the same prediction under
    torchrun (`-m flows.worker predict --pipeline prediction`): the same predictions."""
    node1, node2 = testbed.hosts[:2]
    model = testbed.bed.view / "outputs" / "distributed-train" / "model.pt"  # each host's own
    flow = [
        "enn",
        "run",
        "--flow",
        "prediction",
        "--model",
        str(model),
        *_sets("predict.chunk_rows=4", *_multinode(testbed, "flow-1")),
    ]
    params = [h.checkout / "prediction" / "params.yaml" for h in (node1, node2)]
    before = [p.read_bytes() for p in params]
    job = Job.start([node1, node2], flow, tmp_path, "flow")
    assert job.wait() == [0, 0], job.output()
    # the shared parts_dir lies outside each checkout: no host's tracked file takes its path
    assert [p.read_bytes() for p in params] == before
    assert "lies outside the project" in job.logs[0].read_text()
    flow_preds, flow_keys = _outputs(node1, "prediction")
    assert (node1.checkout / "prediction" / "outputs" / "collapse-check").is_dir()
    assert not (node2.checkout / "prediction" / "outputs" / "predict").exists()
    assert not (node2.checkout / "prediction" / "outputs" / "collapse-check").exists()
    node2_log = job.logs[1].read_text()
    assert "predict: this node's share is done; the node of global rank 0" in node2_log
    assert "collapse-check       not run  (the node of global rank 0 runs it)" in node2_log

    torchrun = [
        "torchrun",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=enn-c10d",
        f"--rdzv-endpoint={node1.name}:{testbed.bed.port(31)}",
        "--rdzv-id=predict-torchrun",
        "-m",
        "flows.worker",
        "predict",
        "--pipeline",
        "prediction",
        *_sets(
            f"predict.model={model}",
            f"predict.parts_dir={testbed.shared / 'predict-parts'}",
        ),
    ]
    job = Job.start([node1, node2], torchrun, tmp_path, "torchrun-predict")
    assert job.wait() == [0, 0], job.output()
    predictions, keys = _outputs(node1, "prediction")
    assert np.array_equal(predictions, flow_preds) and keys == flow_keys
