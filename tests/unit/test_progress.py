"""What the launching process says while workers train (enn_core/progress.py): each event rank 0
writes, in the shape its writer gives it, becomes the one line a person reads, once."""

from __future__ import annotations

import logging

import pytest

from enn_core.events import EventLog
from enn_core.progress import TrainingFollower
from enn_core.runtime.heartbeat import Heartbeat
from enn_core.runtime.memory import MemoryGovernor
from enn_core.runtime.sampler import Plan


@pytest.fixture
def said(caplog):
    caplog.set_level(logging.INFO, logger="enn.test-progress")

    def lines() -> list[str]:
        out = [f"{r.levelname} {r.getMessage()}" for r in caplog.records]
        caplog.clear()
        return out

    return lines


def test_resume_backoff_restart_and_early_stop_lines(tmp_path, said):
    log = logging.getLogger("enn.test-progress")
    follower = TrainingFollower(tmp_path, None, "distributed-train", log, bar_on=False)
    events = EventLog(tmp_path)  # what rank 0 writes (enn_core/train)
    follower.poll()
    assert said() == []  # nothing written yet: nothing said

    # enn_core/train/resume.py: a checkpoint saved by 2 workers, resumed by 1
    ckpt = tmp_path / "checkpoints" / "step-00000040"
    events.event("resumed", checkpoint=str(ckpt), position=40, saved_world_size=2, world_size=1)
    # enn_core/train/state.py back_off: the governor's record of the back-off
    governor = MemoryGovernor(Plan(global_batch=16, world_size=2, micro_batch=8), max_backoffs=3)
    governor.back_off(epoch=0, step=42, reason="CUDA out of memory. Tried to allocate 2.00 GiB")
    events.event("oom_backoff", **governor.history[-1])
    events.event("epoch", epochs=5, epoch=0, train_loss=0.5, val_loss=0.25, val_mae=1.5, lr=0.01)
    follower.poll()
    assert said() == [
        "INFO distributed-train: resumed from step-00000040 (saved by 2 worker(s), now 1)",
        "WARNING distributed-train: out of memory at step 42: micro-batch 8 -> 4 (accumulation 2)",
        "INFO distributed-train: epoch 1/5  train loss 0.5  val loss 0.25  val MAE 1.5  "
        "lr 1.00e-02",
    ]
    follower.poll()
    assert said() == []  # each event once

    # enn_core/runtime/heartbeat.py: the elastic agent restarted the workers (attempt 1 of 0..)
    Heartbeat(tmp_path, rank=0, attempt=0).phase("step", 40)
    follower.poll()
    assert said() == []  # the first attempt is no restart
    Heartbeat(tmp_path, rank=0, attempt=1).phase("step", 40)
    follower.poll()
    assert said() == ["WARNING distributed-train: workers restarted (attempt 2)"]
    follower.poll()
    assert said() == []

    # enn_core/train/loop.py early_stop (0-based epochs): stopped after the 4th, best the 2nd
    events.event("early_stop", epoch=3, best_epoch=1, best_val_loss=0.125)
    follower.poll()
    assert said() == [
        "INFO distributed-train: early stop after epoch 4 (train.patience): keeping epoch 2's "
        "weights, val loss 0.125"
    ]
    follower.close()


def test_a_line_caught_half_written_is_read_once_complete(tmp_path, said):
    log = logging.getLogger("enn.test-progress")
    follower = TrainingFollower(tmp_path, None, "distributed-train", log, bar_on=False)
    line = '{"type": "event", "name": "early_stop", "fields": {"epoch": 2, "best_epoch": 0, '
    (tmp_path / "events.jsonl").write_text(line)
    follower.poll()
    assert said() == []
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('"best_val_loss": 0.5}}\n')
    follower.poll()
    assert [s.split(":")[1] for s in said()] == [" early stop after epoch 3 (train.patience)"]


def _terminal(monkeypatch) -> tuple[int, object]:
    """stderr on a pseudo-terminal of 100 x 24 (what `enn` sees in a terminal); returns the
    master's file descriptor, from which the test reads what the terminal received."""
    import fcntl
    import os
    import struct
    import sys
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    tty = os.fdopen(slave, "w", buffering=1)
    monkeypatch.setattr(sys, "stderr", tty)
    return master, tty


def _read(master: int) -> str:
    import os
    import select

    out = b""
    while select.select([master], [], [], 0.2)[0]:
        out += os.read(master, 65536)
    return out.decode(errors="replace")


def test_the_bar_never_goes_back_to_a_validation_or_checkpoint_heartbeat(tmp_path, monkeypatch):
    """In a terminal the bar follows the optimizer steps of rank 0's heartbeat; validate's
    heartbeat (its step is the epoch) once flashed a stale "0%  1/575 ... 7:03:14" bar at
    every epoch line."""
    import re

    master, tty = _terminal(monkeypatch)
    log = logging.getLogger("enn.test-progress")
    follower = TrainingFollower(tmp_path, 575, "distributed-train", log, bar_on=True)
    beat = Heartbeat(tmp_path, rank=0, attempt=0)
    for phase, step in (("step", 40), ("step", 44), ("validate", 1), ("checkpoint", 0)):
        beat.phase(phase, step)
        follower.poll()
    beat.phase("step", 46)
    follower.poll()
    follower.close()
    tty.flush()
    shown = [int(n) for n in re.findall(r"distributed-train:.*?\| *(\d+)/575", _read(master))]
    assert shown and shown == sorted(shown) and shown[-1] == 46, shown


def test_a_blink_of_work_draws_no_bar(monkeypatch):
    """Staging one chunk in a few seconds drew "stage-data: 0chunk [00:00, ?chunk/s]" for
    its whole length; a bar shows once the work has lasted BAR_DELAY_S, at an update."""
    from enn_core.progress import bar

    master, tty = _terminal(monkeypatch)
    with bar(None, "stage-data", True, unit="chunk") as pbar:
        pbar.update(1)
    tty.flush()
    assert "chunk" not in _read(master)


def test_an_epoch_line_fits_110_columns_with_the_consoles_time(tmp_path, said):
    """Issue 39: epoch lines of 121-123 characters wrapped in 120 columns."""
    log = logging.getLogger("enn.test-progress")
    follower = TrainingFollower(tmp_path, None, "distributed-train", log, bar_on=False)
    events = EventLog(tmp_path)
    for epoch in range(2):
        events.event(
            "epoch",
            epochs=1000,
            epoch=epoch,
            train_loss=0.077251,
            val_loss=0.082881,
            val_mae=12.0513,
            lr=0.000540,
            samples_per_s=12345.0,
            epoch_s=0.9,
        )
    follower.poll()
    lines = said()
    assert len(lines) == 2, lines
    for line in lines:
        message = line.removeprefix("INFO ")
        assert len("12:34:56 " + message) <= 110, (len(message), message)
        assert "epoch " in message and "train loss 0.07725" in message, message
        assert "val loss 0.08288" in message and "val MAE 12.05" in message and "left" in message
