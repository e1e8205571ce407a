"""What the launching process shows while workers train (the bar itself: enn_core/bars.py,
re-exported here), and the progress lines of any long loop where no bar shows (`Ticker`).

Bars show on a terminal when `runtime.progress` is on. Where none shows (CI logs, Prefect
workers, a SLURM job's output, `nohup`, output to a file), a loop says where it is in a line
at most every `runtime.progress_every_s` seconds (60), through the stage's logger, so the
console, the log file and Prefect's log all get it; a loop shorter than that says nothing:

    tick = Ticker("predict", total=n_rows, unit="rows", every_s=60.0, logger=log)
    for chunk in chunks:
        ...
        tick.update(len(chunk))     # predict: 1,200,000/3,000,000 rows  52,000 rows/s  ~0:35 left

Training runs in worker processes whose output goes to per-rank log files, so the launching
process follows rank 0's events and heartbeat (`follow_training`): one log line per epoch as
it happens, a step line within the epoch (a `Ticker` over the heartbeat's step), the resume,
back-off, restart, early-stop and max-steps messages, and the bar with the last loss.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from enn_core.bars import BAR_DELAY_S, bar, shows
from enn_core.events import EVENTS_FILE, EventTail
from enn_core.runtime.heartbeat import read_heartbeats

__all__ = [
    "BAR_DELAY_S",
    "TRAINING_PHASES",
    "Ticker",
    "TrainingFollower",
    "bar",
    "follow_training",
    "shows",
]

TRAINING_PHASES = ("first_forward", "step")  # heartbeat phases whose `step` is the optimizer's


def _duration(s: float) -> str:
    s = int(s)
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class Ticker:
    """A progress line at most every `every_s` seconds of a long loop, where no bar shows
    (`quiet`: one does; `every_s` 0: never). The rate counts from the ticker's start (`start`
    units done then); `rows_per_unit` turns a count of steps into rows/s."""

    def __init__(
        self,
        desc: str,
        total: int | None,
        *,
        unit: str = "rows",
        every_s: float = 60.0,
        logger: logging.Logger | None = None,
        quiet: bool = False,
        rows_per_unit: int | None = None,
        start: int = 0,
    ) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.every_s, self.rows_per_unit = every_s, rows_per_unit
        self.log = logger or logging.getLogger("enn")
        self.enabled = every_s > 0 and not quiet
        self.t0 = self.last = time.monotonic()
        self.start = self.done = start

    def update(self, n: int = 1) -> None:
        """`n` more units done."""
        self.at(self.done + n)

    def at(self, done: int, note: str = "") -> None:
        """`done` units done so far; says so when the last line is `every_s` seconds old."""
        self.done = done
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self.log.info("%s", self.line(now, note))

    def line(self, now: float, note: str = "") -> str:
        """`desc: 1,200/135,469 steps (note)  5,980 rows/s  ~1:02:14 left`."""
        count = f"{self.done:,}/{self.total:,}" if self.total else f"{self.done:,}"
        parts = [f"{self.desc}: {count} {self.unit}" + (f" ({note})" if note else "")]
        if self.done > self.start:
            rate = (self.done - self.start) / max(now - self.t0, 1e-9)
            if self.rows_per_unit:
                parts.append(f"{_rate(rate * self.rows_per_unit)} rows/s")
            else:
                parts.append(f"{_rate(rate)} {self.unit}/s")
            if self.total and self.total > self.done:
                parts.append(f"~{_duration((self.total - self.done) / rate)} left")
        return "  ".join(parts)


def _rate(per_s: float) -> str:
    """5,980 as it is; below 10 with two significant digits (a 504M-parameter model's 16 rows
    in 76 s read "0 rows/s")."""
    return f"{per_s:,.0f}" if per_s >= 10 else f"{per_s:.2g}"


@contextlib.contextmanager
def follow_training(
    run_dir: Path,
    total: int | None,
    desc: str,
    logger: logging.Logger,
    bar_enabled: bool = True,
    interval: float = 0.5,
    every_s: float = 60.0,
    epochs: int | None = None,
) -> Iterator[None]:
    """While the body (the worker launch) runs: one log line per epoch as rank 0 records it,
    the resume, back-off, restart and early-stop messages when they happen, on a terminal a
    bar over rank 0's heartbeat step with the last loss, and elsewhere a step line at most
    every `every_s` seconds (runtime.progress_every_s)."""
    follower = TrainingFollower(run_dir, total, desc, logger, bar_enabled, every_s, epochs)
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


# rank 0's resolved values the step line needs (enn_core/train/loop.py setup)
RESOLVED_SIZES = {
    "resolved.train.batch_size": "batch_size",
    "resolved.train.steps_per_epoch": "steps_per_epoch",
}
EPOCH_LINE_WIDTH = 110  # an epoch line with the console's `HH:MM:SS ` fits this many columns


class TrainingFollower:
    """Reads rank 0's events (new lines only) and heartbeat; says what happened."""

    def __init__(
        self,
        run_dir: Path,
        total: int | None,
        desc: str,
        logger: logging.Logger,
        bar_on: bool,
        every_s: float = 60.0,
        epochs: int | None = None,
    ) -> None:
        self.events = EventTail(Path(run_dir) / EVENTS_FILE)
        self.run_dir, self.desc, self.log = Path(run_dir), desc, logger
        self.pbar = bar(total, desc, bar_on, unit="step", delay=0.0)  # drawn by refresh()
        self.attempt = 0
        self.epoch_s: list[float] = []
        self.every_s = every_s
        self.ticker: Ticker | None = None  # from the first training step this attempt saw
        # rank 0's batch_size and steps_per_epoch (its params), train.epochs
        self.resolved: dict[str, int] = {"epochs": epochs} if epochs else {}

    def poll(self) -> None:
        for rec in self.events.new():
            self._handle(rec)
        beat = read_heartbeats(self.run_dir).get(0) or {}
        attempt = beat.get("attempt")
        if isinstance(attempt, int) and attempt > self.attempt:
            self.log.warning("%s: workers restarted (attempt %d)", self.desc, attempt + 1)
            self.attempt = attempt
            self.pbar.n = 0  # the restarted workers resume from their last checkpoint's step
            self.ticker = None  # and their rate starts again
        step = beat.get("step")
        # only the training phases count optimizer steps (validate's heartbeat carries the
        # epoch, a checkpoint's its position): a bar moved by those flashed "1/575 ... 7:03:14"
        if beat.get("phase") not in TRAINING_PHASES or not isinstance(step, int):
            return
        if not self.pbar.disable and step >= self.pbar.n:
            self.pbar.n = step
            self.pbar.refresh()
        self._tick(step)

    def _tick(self, step: int) -> None:
        """Where no bar shows, a step line: `distributed-train: 1,200/135,469 steps (epoch
        1/2)  5,980 rows/s  ~6:14:00 left` (the heartbeat's step: the steps done before it)."""
        if self.ticker is None:
            self.ticker = Ticker(
                self.desc,
                self.pbar.total,
                unit="steps",
                every_s=self.every_s,
                logger=self.log,
                quiet=not self.pbar.disable,
                rows_per_unit=self.resolved.get("batch_size"),
                start=step,
            )
            return
        self.ticker.total = self.pbar.total
        spe, epochs = self.resolved.get("steps_per_epoch"), self._epochs(None)
        note = f"epoch {step // spe + 1}/{epochs}" if spe and epochs else ""
        self.ticker.at(step, note)

    def _epochs(self, said: int | None) -> int | None:
        """The epochs this run trains: train.epochs (`said` by the epoch's record), or fewer
        when train.max_steps ends it sooner (the run's total steps; before, `epoch 1/20` and
        an ETA of 19 epochs more for a run that stopped within its first)."""
        spe, total = self.resolved.get("steps_per_epoch"), self.pbar.total
        epochs = said or self.resolved.get("epochs")
        if epochs and spe and total:
            return min(epochs, -(-int(total) // spe))
        return epochs

    def close(self) -> None:
        self.pbar.close()

    def _handle(self, rec: dict[str, Any]) -> None:
        kind, name = rec.get("type"), rec.get("name")
        if kind == "param" and name == "resolved.train.total_steps":
            self.pbar.total = int(rec["value"])
            return
        if kind == "param" and name in RESOLVED_SIZES:
            self.resolved[RESOLVED_SIZES[name]] = int(rec["value"])
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
        elif name == "max_steps":
            self.log.info(
                "%s: stopped at train.max_steps=%s (epoch %d)",
                self.desc,
                f.get("max_steps"),
                int(f.get("epoch", 0)) + 1,
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
        epoch, epochs = int(f.get("epoch", 0)) + 1, self._epochs(int(f.get("epochs", 0))) or 0
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
