"""Distributed checkpoints: resume at the exact step, elastic restarts after a SIGKILL, a
crash during a save, a hang, resume at another world size, async save, fingerprint refusal,
a SIGTERM mid-epoch (preemption: an agreed save, then a resume).

The oracle is an uninterrupted run of the same config in the same project: deterministic
settings make a resumed run's final weights bit-identical to it (same world size)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from enn_core.data.dataset import StagedDataset
from enn_core.errors import ConfigError, EnnError, WorkerError
from enn_core.events import read_events
from enn_core.runtime.heartbeat import read_heartbeats
from enn_core.stage import make_context
from enn_core.stages import DISTRIBUTED_TRAIN, STAGE_DATA
from enn_core.train.ckpt import COMMITTED, COMPLETE, committed
from enn_core.train.fingerprint import fingerprint
from tests.fixtures.distributed import alive, cfg_of, make_project, outputs, run_train, worker_pids

pytestmark = pytest.mark.timeout(300)

# 2 epochs of 9 steps (batch 4 over the tiny split), a checkpoint every 3 steps.
BASE = ("train.epochs=2", "train.batch_size=4", "train.patience=0", "checkpoint.every_steps=3")


@pytest.fixture(scope="module")
def tiny_project(tmp_path_factory):
    """One project for the module: every run starts where the previous one left its
    checkpoints, which is what users do (a finished run's COMPLETE makes the next fresh)."""
    return make_project(tmp_path_factory.mktemp("ckpt") / "proj")


@pytest.fixture(scope="module")
def ref(tiny_project) -> dict[str, torch.Tensor]:
    """The uninterrupted run's final weights (2 workers)."""
    summary, _ = run_train(tiny_project, cfg_of(*BASE))
    assert (Path(summary["checkpoint"]["dir"]) / COMPLETE).exists()
    return outputs(tiny_project)[1]


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def fault(kind: str, phase: str, step: int, rank: int = -1, **more) -> tuple[str, ...]:
    out = [f"fault.kind={kind}", f"fault.phase={phase}", f"fault.step={step}", f"fault.rank={rank}"]
    return (*out, *(f"fault.{k}={v}" for k, v in more.items()))


def params(run_dir: Path) -> dict:
    return {e["name"]: e["value"] for e in read_events(run_dir) if e.get("type") == "param"}


def test_interrupted_run_resumes_at_the_exact_step_bit_identical(tiny_project, ref):
    with pytest.raises(Exception, match="injected fault"):
        run_train(tiny_project, cfg_of(*BASE, *fault("raise", "step", 7)))
    staged = StagedDataset(STAGE_DATA.output_dir(tiny_project)).fingerprint
    root = tiny_project.checkpoints / fingerprint(cfg_of(*BASE), staged).digest
    assert [p.name for p in committed(root)][-1] == "step-00000006"  # 3 and 6 committed, keep 2
    summary, run_dir = run_train(tiny_project, cfg_of(*BASE))
    assert summary["checkpoint"]["resumed_from"].endswith("step-00000006")
    assert params(run_dir)["resolved.checkpoint.resumed_from"].endswith("step-00000006")
    history, state = outputs(tiny_project)
    assert len(history["step_losses"]) == 18  # the resumed curve holds every step once
    assert_same(state, ref)


def test_sigkilled_worker_restarts_from_checkpoint_bit_identical(tiny_project, ref):
    summary, run_dir = run_train(
        tiny_project, cfg_of(*BASE, "runtime.max_restarts=1", *fault("kill", "step", 8, rank=1))
    )
    assert summary["checkpoint"]["attempt"] == 1
    assert summary["checkpoint"]["resumed_from"].endswith("step-00000006")
    assert params(run_dir)["resolved.workers.restarts"] == 1
    # the stage's summary (the Prefect task's), its record and its metrics (dvc metrics) too
    out = DISTRIBUTED_TRAIN.output_dir(tiny_project)
    published = json.loads((out / "record.json").read_text())
    for record in (summary, published):
        assert record["restarts"] == 1 and sorted(record["rank_phases"]) == ["0", "1"], record
    assert json.loads((out / "metrics.json").read_text())["train/restarts"] == 1
    assert_same(outputs(tiny_project)[1], ref)
    assert not alive(worker_pids(run_dir))


def test_crash_during_a_save_leaves_the_previous_checkpoint_usable(tiny_project, ref):
    # rank 0 dies after writing step 6's shards, before its commit marker
    summary, _ = run_train(
        tiny_project,
        cfg_of(*BASE, "runtime.max_restarts=1", *fault("kill", "checkpoint_save", 6, rank=0)),
    )
    assert summary["checkpoint"]["resumed_from"].endswith("step-00000003")
    assert_same(outputs(tiny_project)[1], ref)
    root = Path(summary["checkpoint"]["dir"])
    assert all((p / COMMITTED).exists() for p in root.glob("step-*"))
    assert not list(root.glob(".tmp-*"))


def test_hang_restarts_and_exhausted_restarts_list_every_attempt(tiny_project):
    hang = ("runtime.max_restarts=1", "runtime.hang_timeout_s=10")  # 3 hangs: 30 s of waiting
    summary, run_dir = run_train(
        tiny_project, cfg_of(*BASE, *hang, *fault("hang", "step", 7, rank=1, seconds=600))
    )
    assert summary["checkpoint"]["resumed_from"].endswith("step-00000006")
    with pytest.raises(WorkerError) as e:
        run_train(
            tiny_project,
            cfg_of(*BASE, *hang, *fault("hang", "step", -1, rank=1, seconds=600, times=2)),
        )
    msg = str(e.value)
    assert "attempt 0: rank 1 hung in phase" in msg and "attempt 1: rank 1 hung in phase" in msg


def test_resume_at_another_world_size(tiny_project, ref):
    with pytest.raises(Exception, match="injected fault"):
        run_train(tiny_project, cfg_of(*BASE, *fault("raise", "step", 7)))
    summary, _ = run_train(tiny_project, cfg_of(*BASE, "runtime.world_size=1"))
    assert summary["world_size"] == 1
    assert summary["checkpoint"]["resumed_from"].endswith("step-00000006")
    state = outputs(tiny_project)[1]
    # 2 -> 1 ranks: the summation order differs, so equal within the oracle's rtol; atol for
    # the near-zero entries where Adam turns summation noise into lr-sized steps
    for k in ref:
        torch.testing.assert_close(state[k], ref[k], rtol=1e-4, atol=1e-4)


def test_async_save_matches_sync_and_resumes(tiny_project, ref):
    with pytest.raises(Exception, match="injected fault"):
        run_train(
            tiny_project, cfg_of(*BASE, "checkpoint.async_save=true", *fault("raise", "step", 7))
        )
    summary, run_dir = run_train(tiny_project, cfg_of(*BASE, "checkpoint.async_save=true"))
    # step 6's save may still have been in flight at the fault (then uncommitted, swept)
    assert summary["checkpoint"]["resumed_from"].endswith(("step-00000003", "step-00000006"))
    assert_same(outputs(tiny_project)[1], ref)
    started = [e for e in read_events(run_dir) if e.get("name") == "checkpoint_started"]
    assert started, "async saves report the time training was blocked"


def test_foreign_checkpoint_is_refused_with_the_difference_unless_warm_start(tiny_project):
    summary, _ = run_train(tiny_project, cfg_of(*BASE, "train.lr=0.02"))
    step = committed(Path(summary["checkpoint"]["dir"]))[-1]
    with pytest.raises(ConfigError, match=r"train\.lr: 0\.02 there, 0\.01 here.*warm_start"):
        run_train(tiny_project, cfg_of(*BASE, "train.lr=0.01", f"checkpoint.resume_from={step}"))
    summary, run_dir = run_train(
        tiny_project,
        cfg_of(
            *BASE, "train.lr=0.01", f"checkpoint.resume_from={step}", "checkpoint.warm_start=true"
        ),
    )
    assert any(e.get("name") == "warm_start" for e in read_events(run_dir))
    assert (
        json.loads((Path(summary["checkpoint"]["dir"]) / "fingerprint.json").read_text())["train"][
            "lr"
        ]
        == 0.01
    )


# -- broken checkpoints, full disks (issue 16; crafted files are refused by the reader that
# every worker's resume uses: tests/unit/train/test_resume.py) ---------------------------------


def _interrupted(tiny_project) -> Path:
    """The newest committed checkpoint of a run stopped at step 7 (3 and 6 committed)."""
    with pytest.raises(Exception, match="injected fault"):
        run_train(tiny_project, cfg_of(*BASE, *fault("raise", "step", 7)))
    staged = StagedDataset(STAGE_DATA.output_dir(tiny_project)).fingerprint
    root = tiny_project.checkpoints / fingerprint(cfg_of(*BASE), staged).digest
    return committed(root)[-1]


def test_a_corrupt_checkpoint_is_quarantined_and_resume_falls_back(tiny_project, ref):
    step = _interrupted(tiny_project)
    shard = next(step.glob("__0_0.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(1000)
    summary, run_dir = run_train(tiny_project, cfg_of(*BASE))
    info = summary["checkpoint"]
    assert info["resumed_from"].endswith("step-00000003"), info  # the previous one
    assert len(info["quarantined"]) == 1 and "quarantine/step-00000006-" in info["quarantined"][0]
    moved = [e for e in read_events(run_dir) if e.get("name") == "checkpoint_quarantined"]
    assert moved and moved[0]["fields"]["files"] == ["__0_0.distcp"]
    assert params(run_dir)["resolved.checkpoint.quarantined"] == info["quarantined"][0]
    assert_same(outputs(tiny_project)[1], ref)  # and the result is the uninterrupted one


def test_a_full_disk_during_a_save_is_named_and_its_temp_files_swept(tmp_path, tmpfs):
    import subprocess

    from enn_core.errors import NoSpaceError
    from enn_core.paths import Layout

    work = tmpfs(tmp_path / "work", size="1m")
    layout = make_project(tmp_path / "proj")
    full = Layout.for_root(layout.root, str(work))
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={work / 'filler'}", "bs=1k", "count=600"], check=True
    )
    with pytest.raises(NoSpaceError) as e:
        run_train(full, cfg_of(*BASE))
    msg = str(e.value)
    assert "no space left on the device" in msg and "MiB free of 1 MiB" in msg, msg
    assert str(work) in msg and "\n" not in msg
    assert e.value.exit_code == 11
    # half-written checkpoints (.tmp-step-*), atomic files (.tmp-*) and the heartbeat files
    # caught before their rename (.rank-<r>.json.<pid>.<tid>.tmp): none is left behind
    left = [p for p in work.rglob("*") if p.name.startswith(".tmp-") or p.name.endswith(".tmp")]
    assert not left, sorted(str(p) for p in left)


def test_sigterm_mid_epoch_saves_an_agreed_checkpoint_and_the_rerun_resumes_bit_identical(
    tiny_project, ref
):
    """A real SIGTERM to rank 1 alone (what SLURM's requeue, Kubernetes or a cancelled flow
    send) while it pauses at step 7: both ranks save at step 8 (not a periodic position: every
    3 steps), the checkpoint is committed, the workers end with Preempted, the run is not
    COMPLETE; the same command again resumes from step 8 and ends as the uninterrupted run."""
    cfg = cfg_of(*BASE, *fault("delay", "step", 7, rank=1, seconds=8))
    ctx = make_context(cfg, tiny_project, DISTRIBUTED_TRAIN, uuid.uuid4().hex[:8])
    signalled: list[int] = []

    def signal_rank1() -> None:
        end = time.time() + 120
        while time.time() < end:
            beat = read_heartbeats(ctx.run_dir).get(1) or {}
            if (beat.get("phase"), beat.get("step")) == ("step", 7):
                os.kill(int(beat["pid"]), signal.SIGTERM)
                signalled.append(int(beat["pid"]))
                return
            time.sleep(0.1)

    sender = threading.Thread(target=signal_rank1, daemon=True)
    sender.start()
    with pytest.raises(EnnError) as e:
        DISTRIBUTED_TRAIN.work(cfg, ctx)
    sender.join()
    assert signalled, "rank 1 never reached step 7"
    assert "preemption" in str(e.value), e.value
    stopped = [x["fields"] for x in read_events(ctx.run_dir) if x.get("name") == "preempted"]
    assert stopped == [{"position": 8, "signal": "a peer rank's"}], stopped  # rank 0's record
    staged = StagedDataset(STAGE_DATA.output_dir(tiny_project)).fingerprint
    root = tiny_project.checkpoints / fingerprint(cfg_of(*BASE), staged).digest
    assert [p.name for p in committed(root)][-1] == "step-00000008"
    assert not (root / COMPLETE).exists()
    errors = [json.loads(p.read_text()) for p in (ctx.run_dir / "errors").glob("rank-*.json")]
    assert sorted((r["rank"], r["type"]) for r in errors) == [(0, "Preempted"), (1, "Preempted")]
    summary, _ = run_train(tiny_project, cfg_of(*BASE))
    assert summary["checkpoint"]["resumed_from"].endswith("step-00000008")
    assert_same(outputs(tiny_project)[1], ref)
