"""Issue 51 point 5: running out of memory is one line and exit code 13, never a traceback, in
each of the three forms it takes on CPU, each provoked for real through `enn <stage>`:

- numpy's MemoryError in the stage's own process (stage-data allocating an impossible array);
- torch's CPU allocator ("DefaultCPUAllocator: can't allocate memory") in a training worker;
- a training worker killed by SIGKILL, as the kernel's out-of-memory killer does: it raises
  nothing, and the launcher knows it from the worker's exit signal.

The allocations (fault kinds alloc_numpy and alloc_torch, enn_core/fault.py) ask for 256 TiB,
more than a 64-bit process can map: they fail at once on any machine and touch nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from enn_core.errors import OutOfMemory, oom_held, out_of_memory
from tests.fixtures.cli import enn
from tests.fixtures.project import TINY

TRAIN_SETTINGS = "lower one of train.batch_size, train.micro_batch, train.eval_batch, "
TRAIN_SETTINGS += "runtime.world_size and run it again (docs/troubleshooting.md)"


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A tiny synthetic project, staged and with its initial checkpoint."""
    root = tmp_path_factory.mktemp("oom")
    params = {**TINY, "tracking": {"enabled": False}, "train": {**TINY["train"], "epochs": 1}}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    for stage in ("stage-data", "prepare-checkpoint"):
        code, lines = enn(root, stage)
        assert code == 0, lines
    return root


def faulted(monkeypatch, project: Path, stage: str, *sets: str) -> str:
    """`enn <stage> --set ...` with faults allowed: it exits 13 with its error in one line,
    the last it wrote (distributed-train says first how many workers it starts)."""
    monkeypatch.setenv("ENN_ALLOW_FAULTS", "1")
    code, lines = enn(project, stage, *(f"--set={s}" for s in sets))
    assert code == 13, lines
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], lines
    assert not any("Traceback" in line for line in lines), lines
    return lines[-1]


def test_numpy_memory_error_in_a_stage_is_one_line_naming_the_setting(monkeypatch, project):
    line = faulted(
        monkeypatch, project, "stage-data", "fault.kind=alloc_numpy", "fault.phase=stage-data"
    )
    assert line.startswith(
        "error: stage-data: out of memory: tried to allocate 256. TiB for an array with shape "
        "(281474976710656,) (MemoryError); lower data.chunk_rows and run it again"
    ), line


def test_torch_cpu_allocator_error_in_a_worker_is_one_line(monkeypatch, project):
    line = faulted(
        monkeypatch,
        project,
        "distributed-train",
        "fault.kind=alloc_torch",
        "fault.phase=step",
        "fault.step=1",
    )
    assert line.startswith(
        "error: distributed-train: rank 0 ran out of memory in phase step step 1: "
        "tried to allocate 256.0 TiB (281474976710656 bytes) (RuntimeError; logs in "
    ), line
    assert line.endswith(TRAIN_SETTINGS), line


def test_a_worker_killed_by_sigkill_is_named_as_the_oom_killer(monkeypatch, project):
    line = faulted(
        monkeypatch,
        project,
        "distributed-train",
        "fault.kind=kill",  # the worker SIGKILLs itself, as the kernel's OOM killer would
        "fault.phase=step",
        "fault.step=1",
    )
    assert line.startswith(
        "error: distributed-train: rank 0 was killed by signal 9 (SIGKILL, no "
        "Python error) in phase step step 1, most likely by the kernel's out-of-memory killer "
        "(`dmesg` or `journalctl -k`"
    ), line
    assert line.endswith(TRAIN_SETTINGS), line


def test_each_real_allocator_error_says_what_it_tried_to_hold():
    """The messages as numpy and torch really word them (not copies that could drift)."""
    errors: list[BaseException] = []
    for alloc in (
        lambda: np.empty((2**24, 2**24)),
        lambda: torch.empty(2**46),
    ):
        try:
            alloc()
        except (MemoryError, RuntimeError) as e:
            errors.append(e)
    numpy_error, torch_error = errors
    assert oom_held(type(numpy_error).__name__, str(numpy_error)) == (
        "2.00 PiB for an array with shape (16777216, 16777216)"
    )
    assert oom_held("RuntimeError", str(torch_error)) == "256.0 TiB (281474976710656 bytes)"
    oom = out_of_memory(torch_error, "predict", ("predict.batch_size", "predict.chunk_rows"))
    assert isinstance(oom, OutOfMemory) and str(oom) == (
        "predict: out of memory: tried to allocate 256.0 TiB (281474976710656 bytes) "
        "(RuntimeError); lower one of predict.batch_size, predict.chunk_rows and run it again"
    )
    assert oom_held("RuntimeError", "Expected all tensors to be on the same device") is None
    assert oom_held("OSError", "[Errno 12] Cannot allocate memory") == ""
    assert out_of_memory(ValueError("out of memory"), "predict", ()) is None
    assert str(out_of_memory(MemoryError(), "check-new-predictions", ())) == (
        "check-new-predictions: out of memory: it says no more (MemoryError); no setting bounds "
        "what it holds: run it where more memory is free"
    )


def test_out_of_memory_outside_a_stage_is_one_line_naming_the_command(monkeypatch, tmp_path):
    """`enn doctor` (as `serve` or tune's own process) allocating more than there is: before,
    a numpy traceback. The allocation is real (256 TiB, refused at once); only where the
    doctor makes it is chosen here."""
    import enn_core.doctor

    def doctor(*_args, **_kwargs) -> int:
        np.empty(2**48, dtype=np.uint8)
        return 0

    monkeypatch.setattr(enn_core.doctor, "main", doctor)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"tracking": {"enabled": False}}))
    code, lines = enn(tmp_path, "doctor")
    assert code == 13, lines
    assert not any("Traceback" in line for line in lines), lines
    said = "error: enn doctor: out of memory: tried to allocate 256. TiB"
    assert lines[-1].startswith(said), lines
    assert "run it where more memory is free" in lines[-1]
