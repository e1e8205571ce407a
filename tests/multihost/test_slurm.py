"""The pipeline on a real scheduler: SLURM's daemons in the test bed (tests/fixtures/slurm.py:
slurmctld on node3, slurmd on node1 and node2, munged everywhere) and the batch scripts of
deploy/slurm/ submitted with sbatch as written, from node1's checkout, with only their
documented variables set.

The training job is preempted mid-epoch by the time-limit warning (`scancel --batch
--signal=USR2`, what `--signal=B:USR2@<grace>` sends): the workers save a committed
checkpoint at the step they agree on, the script requeues the job, and the requeued job
resumes from that checkpoint and ends with weights bit-identical to the uninterrupted job on
one host (the tier's `reference`), then runs the later stages on node1."""

from __future__ import annotations

import json
import time

import pytest

from flows.params_file import apply_overrides
from tests.fixtures.multihost import Job, published_model, same_weights
from tests.fixtures.slurm import Slurm, missing
from tests.multihost.conftest import unavailable

pytestmark = pytest.mark.timeout(600)

TRAIN = "deploy/slurm/train.sbatch"
# rank 1 (node2) pauses once at step 6 (epoch 1, step 1): time to send the warning. The agreed
# save is then at step 7, which no periodic save (every 2 steps, epoch ends at 5, 10) makes.
PAUSE_STEP, SAVED_AT = 6, "step-00000007"


@pytest.fixture(scope="module")
def slurm(testbed, say):
    unavailable(missing())
    started = Slurm.start(testbed, testbed.bed.base / "slurm")
    say(f"SLURM: slurmctld on {started.ctld.name}, slurmd on {[h.name for h in started.computes]}")
    try:
        yield started
    finally:
        started.stop()


def _restore(path):
    before = path.read_bytes()
    return lambda: path.write_bytes(before)


def _log_of(host, job: str) -> str:
    path = host.checkout / f"enn-train-{job}.out"
    return path.read_text(errors="replace") if path.exists() else "(no output file)"


def test_the_training_job_preempted_before_its_time_limit_requeues_and_resumes_bit_identical(
    testbed, slurm, reference, say, request
):
    node1, node2 = testbed.hosts[:2]
    shared = testbed.shared
    pause = [
        "fault.kind=delay",
        "fault.phase=step",
        f"fault.step={PAUSE_STEP}",
        "fault.rank=1",
        "fault.seconds=20",
        f"fault.marker_dir={shared / 'faults-slurm'}",
    ]
    for h in (node1, node2):  # the test's pause, in both checkouts' params.yaml
        request.addfinalizer(_restore(h.checkout / "params.yaml"))
        apply_overrides(h.checkout / "params.yaml", pause)
    env = {
        **node1.env,
        "ENN_SHARED": str(shared),
        "ENN_RDZV_PORT": str(testbed.bed.port(40)),
        "ENN_IFNAME": "eth0",
    }
    started = time.time()
    job = slurm.sbatch(node1, TRAIN, env=env)
    watch = Job([node1, node2], [], [], started=started)
    beats = watch.wait_for_beat(
        lambda r, b: r == 0 or (b["phase"], b.get("step")) == ("step", PAUSE_STEP), timeout=300
    )
    assert beats[1][0] is node2, "the rendezvous orders the nodes by name: node2 holds rank 1"
    running = slurm.show(job)
    say(f"SLURM job {job} running: {_fields(running)}")
    for h in testbed.hosts:
        say(f"during job {job}: {h.name} listens on {', '.join(map(str, h.listening()))}")
    node1.run("scancel", "--batch", "--signal=USR2", job)  # the time-limit warning
    requeued = _wait_restart(slurm, job, node1)
    say(f"after the warning: {_fields(requeued)}")
    done = slurm.wait(job, timeout=420)
    say(f"SLURM job {job} ended: {_fields(done)}")
    out = _log_of(node1, job)
    assert done["JobState"] == "COMPLETED", f"{done}\n{out}\n{slurm.logs()}"
    assert done["Restarts"] == "1" and done["NodeList"] == "node[1-2]", done
    assert "saved before the time limit; requeueing" in out, out
    assert "enn-train: job " + job + " done" in out, out
    results = sorted(
        (node1.checkout / "work" / "runs").glob("*/distributed-train/result.json"),
        key=lambda p: p.stat().st_mtime,
    )
    resumed = json.loads(results[-1].read_text())["checkpoint"]["resumed_from"]
    assert resumed.endswith(SAVED_AT), resumed  # the agreed preemption save
    assert not same_weights(published_model(node1), reference[0])  # bit-identical
    for stage in ("validate", "predict", "collapse-check", "export"):
        made = node1.checkout / "outputs" / stage
        assert made.is_dir() and made.stat().st_mtime > started, stage
    say(f"job {job}: preempted at step {PAUSE_STEP}, resumed from {SAVED_AT}, bit-identical")


def _fields(info: dict[str, str]) -> str:
    keys = ("JobId", "JobState", "Reason", "Restarts", "NodeList", "BatchHost", "ExitCode")
    return " ".join(f"{k}={info.get(k)}" for k in keys)


def _wait_restart(slurm: Slurm, job: str, host, timeout: float = 180) -> dict[str, str]:
    end = time.time() + timeout
    info: dict[str, str] = {}
    while time.time() < end:
        info = slurm.show(job)
        if info.get("Restarts") == "1":
            return info
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"):
            break
        time.sleep(0.5)
    raise AssertionError(f"job {job} was not requeued: {info}\n{_log_of(host, job)}")
