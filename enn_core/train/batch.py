"""`train.batch_size: auto` and `train.eval_batch: auto`: batches that fit the table, with the
reason (logged and recorded once, as the other resolved values are).

    choice = choose_batch(cfg.train.batch_size, train_rows=3_000_000, world_size=1)
    choice.value, choice.reason    # 2048, "auto: 3,000,000 training rows -> ..."
    cfg = with_batch(cfg, choice)  # the stage's job and the fingerprint hold the number

The global batch sets how many optimizer steps an epoch takes. A fixed default was wrong at
both ends: 32 rows made a 3-million-row epoch 94,000 steps (hours on a CPU), while a table of
a few hundred rows needs small batches to take enough steps. The rule grows the batch with
the square root of the rows, so the steps per epoch grow as the square root too (300 rows:
batch 16, 19 steps; 3 million: batch 2048, 1,465 steps), within 16..4096 rows, and never
more than the training rows. It is rounded up to a multiple of the world size (which every
power of two up to it already is), so the same table gives the same batch at any world size
that divides it, and a run resumes at another one.

The training micro-batch (memory) is separate (`train.micro_batch`, runtime/batch_probe.py).
Validation keeps no gradients, so twice the training micro-batch fits where training does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from enn_core.config import RunConfig, TrainConfig

MIN_AUTO_BATCH = 16
MAX_AUTO_BATCH = 4096
MIN_EVAL_BATCH = 256
MAX_EVAL_BATCH = 16384


@dataclass(frozen=True)
class BatchChoice:
    value: int
    reason: str


def choose_batch(requested: int | str, train_rows: int, world_size: int) -> BatchChoice:
    """The global batch: `requested` when it is a number, else the rule above."""
    if requested != "auto":
        return BatchChoice(int(requested), f"train.batch_size={requested}")
    rows = max(int(train_rows), 1)
    nearest = 2 ** round(math.log2(math.sqrt(rows)))
    first = min(max(nearest, MIN_AUTO_BATCH), MAX_AUTO_BATCH, rows)
    world = max(world_size, 1)
    batch = -(-first // world) * world
    # one short line in the log (the rule is in the docstring and docs/your-data.md)
    return BatchChoice(
        batch,
        f"train.batch_size=auto for {rows:,} training rows: {math.ceil(rows / batch):,} steps "
        "an epoch" + (f", a multiple of {world} workers" if batch != first else ""),
    )


def choose_eval_batch(requested: int | str, micro_batch: int) -> BatchChoice:
    """Rows per validation forward on each rank."""
    if requested != "auto":
        return BatchChoice(int(requested), f"train.eval_batch={requested}")
    value = min(max(2 * micro_batch, MIN_EVAL_BATCH), MAX_EVAL_BATCH)
    return BatchChoice(
        value,
        f"train.eval_batch=auto: twice the training micro-batch {micro_batch}, "
        f"within {MIN_EVAL_BATCH}..{MAX_EVAL_BATCH}",
    )


def with_batch(cfg: RunConfig, choice: BatchChoice) -> RunConfig:
    """`cfg` with its global batch resolved (what the workers' job and the fingerprint hold)."""
    return replace(cfg, train=replace(cfg.train, batch_size=choice.value))


def total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """Optimizer steps of the run: train.epochs of them, capped by train.max_steps."""
    total = steps_per_epoch * cfg.epochs
    return min(total, cfg.max_steps) if cfg.max_steps is not None else total
