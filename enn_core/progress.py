"""What the launching process shows while workers train (the bar itself: enn_core/bars.py,
re-exported here).

Bars show on a terminal when `runtime.progress` is on; silent otherwise (CI logs, Prefect
workers, redirected output). Training runs in worker processes whose output goes to per-rank
log files, so the launching process follows rank 0's events and heartbeat
(`follow_training`): one log line per epoch as it happens (terminal, log file, Prefect), the
resume, back-off, restart and early-stop messages, and the bar with the last loss.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from enn_core.bars import BAR_DELAY_S, bar
from enn_core.events import EVENTS_FILE, EventTail
from enn_core.runtime.heartbeat import read_heartbeats

__all__ = ["BAR_DELAY_S", "TRAINING_PHASES", "TrainingFollower", "bar", "follow_training"]

TRAINING_PHASES = ("first_forward", "step")  # heartbeat phases whose `step` is the optimizer's


@contextlib.contextmanager
def follow_training(
    run_dir: Path,
    total: int | None,
    desc: str,
    logger: logging.Logger,
    bar_enabled: bool = True,
    interval: float = 0.5,
) -> Iterator[None]:
    """While the body (the worker launch) runs: one log line per epoch as rank 0 records it,
    the resume, back-off, restart and early-stop messages when they happen, and (on a
    terminal) a bar over rank 0's heartbeat step with the last loss."""
    follower = TrainingFollower(run_dir, total, desc, logger, bar_enabled)
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(interval):
            follower.poll()

    # the caller's context (a Prefect task run's): its log handlers accept the thread's lines
    context = contextvars.copy_context()
    t = threading.Thread(target=context.run, args=(poll,), name="enn-progress", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=2 * interval + 5)
        follower.poll()  # what the workers wrote last
        follower.close()


EPOCH_LINE_WIDTH = 110  # an epoch line with the console's `HH:MM:SS ` fits this many columns


class TrainingFollower:
    """Reads rank 0's events (new lines only) and heartbeat; says what happened."""

    def __init__(
        self, run_dir: Path, total: int | None, desc: str, logger: logging.Logger, bar_on: bool
    ) -> None:
        self.events = EventTail(Path(run_dir) / EVENTS_FILE)
        self.run_dir, self.desc, self.log = Path(run_dir), desc, logger
        self.pbar = bar(total, desc, bar_on, unit="step", delay=0.0)  # drawn by refresh()
        self.attempt = 0
        self.epoch_s: list[float] = []

    def poll(self) -> None:
        for rec in self.events.new():
            self._handle(rec)
        beat = read_heartbeats(self.run_dir).get(0) or {}
        attempt = beat.get("attempt")
        if isinstance(attempt, int) and attempt > self.attempt:
            self.log.warning("%s: workers restarted (attempt %d)", self.desc, attempt + 1)
            self.attempt = attempt
            self.pbar.n = 0  # the restarted workers resume from their last checkpoint's step
        step = beat.get("step")
        # only the training phases count optimizer steps (validate's heartbeat carries the
        # epoch, a checkpoint's its position): a bar moved by those flashed "1/575 ... 7:03:14"
        if not self.pbar.disable and beat.get("phase") in TRAINING_PHASES:
            if isinstance(step, int) and step >= self.pbar.n:
                self.pbar.n = step
                self.pbar.refresh()

    def close(self) -> None:
        self.pbar.close()

    def _handle(self, rec: dict[str, Any]) -> None:
        kind, name = rec.get("type"), rec.get("name")
        if kind == "param" and name == "resolved.train.total_steps":
            self.pbar.total = int(rec["value"])
            return
        if kind != "event":
            return
        f = rec.get("fields") or {}
        if name == "epoch":
            self.log.info("%s", self._epoch_line(f))
            self.pbar.set_postfix_str(f"loss {f.get('train_loss', float('nan')):.4g}", False)
        elif name == "resumed":
            self.log.info(
                "%s: resumed from %s (saved by %s worker(s), now %s)",
                self.desc,
                Path(str(f.get("checkpoint", ""))).name,
                f.get("saved_world_size"),
                f.get("world_size"),
            )
        elif name == "early_stop":
            self.log.info(
                "%s: early stop after epoch %d (train.patience): keeping epoch %d's weights, "
                "val loss %.4g",
                self.desc,
                int(f.get("epoch", 0)) + 1,
                int(f.get("best_epoch", 0)) + 1,
                float(f.get("best_val_loss", float("nan"))),
            )
        elif name == "oom_backoff":
            self.log.warning(
                "%s: out of memory at step %s: micro-batch %s -> %s (accumulation %s)",
                self.desc,
                f.get("step"),
                f.get("micro_batch_before"),
                f.get("micro_batch_after"),
                f.get("accumulation_after"),
            )
        elif name == "nonfinite_skip":
            self.log.warning(
                "%s: non-finite values in %s at step %s: step skipped",
                self.desc,
                f.get("tensor"),
                f.get("step"),
            )

    def _epoch_line(self, f: dict[str, Any]) -> str:
        """`distributed-train: epoch 3/20  train loss 0.1234  val loss 0.1111  val MAE 2.455
        lr 9.5e-03  268 samples/s  ~0:45 left`, within EPOCH_LINE_WIDTH with the console's
        time in front: the rate goes first when it is longer, then the learning rate (both
        are in MLflow), then the double spaces."""
        epoch, epochs = int(f.get("epoch", 0)) + 1, int(f.get("epochs", 0))
        parts = [f"{self.desc}: epoch {epoch}/{epochs}"]
        for key, label in (("train_loss", "train loss"), ("val_loss", "val loss")):
            if isinstance(f.get(key), (int, float)):
                parts.append(f"{label} {f[key]:.4g}")
        if isinstance(f.get("val_mae"), (int, float)):
            parts.append(f"val MAE {f['val_mae']:.4g}")
        optional = []
        if isinstance(f.get("lr"), (int, float)):
            optional.append(f"lr {f['lr']:.2e}")
        if isinstance(f.get("samples_per_s"), (int, float)):
            optional.append(f"{f['samples_per_s']:.0f} samples/s")
        left = []
        if isinstance(f.get("epoch_s"), (int, float)):
            self.epoch_s.append(float(f["epoch_s"]))
            s = (epochs - epoch) * sum(self.epoch_s) / len(self.epoch_s)
            left.append(f"~{int(s // 60)}:{int(s % 60):02d} left")
        room = EPOCH_LINE_WIDTH - len("HH:MM:SS ")
        for keep in (len(optional), len(optional) - 1, 0):
            line = "  ".join(parts + optional[: max(keep, 0)] + left)
            if len(line) <= room:
                return line
        return " ".join(parts + left)
