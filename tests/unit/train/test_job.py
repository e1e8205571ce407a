"""The worker job record: what the distributed-train stage hands its workers, JSON only at the
file boundary, with a format version a worker checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from enn_core.errors import StaleOutputError
from enn_core.train.job import FORMAT_VERSION, CheckpointPlan, WorkerJob
from tests.fixtures.train import tiny_cfg


def job(tmp_path: Path, checkpoint: CheckpointPlan | None) -> WorkerJob:
    return WorkerJob(
        config=tiny_cfg("train.epochs=3", "fault.kind=raise", "fault.phase=step"),
        staged=tmp_path / "outputs/stage-data",
        init=tmp_path / "outputs/prepare-checkpoint/init.pt",
        run_dir=tmp_path / "run",
        result_dir=tmp_path / "run/result",
        threads=2,
        marker_dir=tmp_path / "markers",
        checkpoint=checkpoint,
    )


@pytest.mark.parametrize(
    "plan",
    [
        None,
        CheckpointPlan(dir=Path("/ck/abc"), digest="abc"),
        CheckpointPlan(dir=Path("/ck/abc"), digest="abc", resume_from=Path("/ck/abc/step-3")),
        CheckpointPlan(
            dir=Path("/ck/abc"), digest="abc", resume_from=Path("/x/step-9"), weights_only=True
        ),
    ],
)
def test_a_job_reads_back_as_written(tmp_path, plan):
    written = job(tmp_path, plan)
    path = written.write(tmp_path / "run/job.json")
    assert WorkerJob.read(path) == written
    rec = json.loads(path.read_text())
    assert rec["format_version"] == FORMAT_VERSION and rec["config"]["train"]["epochs"] == 3


def test_resume_or_warm_start_is_one_field_read_two_ways():
    exact = CheckpointPlan(dir=Path("/ck"), digest="d", resume_from=Path("/ck/step-3"))
    assert exact.resume_path == Path("/ck/step-3") and exact.weights_path is None
    warm = CheckpointPlan(
        dir=Path("/ck"), digest="d", resume_from=Path("/o/step-9"), weights_only=True
    )
    assert warm.resume_path is None and warm.weights_path == Path("/o/step-9")
    fresh = CheckpointPlan(dir=Path("/ck"), digest="d")
    assert fresh.resume_path is None and fresh.weights_path is None


@pytest.mark.parametrize("version", [None, 0, FORMAT_VERSION + 1])
def test_a_job_file_of_another_version_is_refused_in_one_line(tmp_path, version):
    path = job(tmp_path, None).write(tmp_path / "job.json")
    rec = json.loads(path.read_text())
    if version is None:
        del rec["format_version"]  # a job.json written before the version existed
    else:
        rec["format_version"] = version
    path.write_text(json.dumps(rec))
    with pytest.raises(StaleOutputError, match=r"format_version .* this worker reads") as e:
        WorkerJob.read(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
