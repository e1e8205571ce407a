"""The distributed sampler: which training rows each rank reads at each step.

One seeded global shuffle per epoch (of contiguous blocks of `shuffle_block` rows, so large
staged files are read in runs), cut into global batches; each global batch is split into
contiguous per-rank slices and each slice into micro-batches. Every training row is used
exactly once per epoch; every rank runs the same number of steps and micro-batches (FSDP
needs every rank in every collective); the last global batch is padded with weight-0 rows
only up to a multiple of the world size (one rank: none), so no step computes rows that count
for nothing (padded to the full batch, 485 rows in batches of 32 computed 512, 5.6% more).

The state is a global position (epoch, step), independent of the world size, so a run can
resume at another world size and read the same global batches.

Batches are read from the memmaps with one vectorized gather per micro-batch, never per
sample (FIELD_NOTES: per-sample reads are ~30x slower).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast, overload

import numpy as np

from enn_core.errors import ConfigError


@dataclass(frozen=True)
class Batch:
    """One micro-batch on the host: raw features, real-unit labels, per-row weights."""

    features: np.ndarray
    labels: np.ndarray
    weights: np.ndarray  # 1.0 for real rows, 0.0 for padding
    rows: np.ndarray  # staged row indices (padding repeats a real row)

    @property
    def n_real(self) -> int:
        """Real rows (weight 1): all of them but in the last batch of an epoch."""
        return len(self.weights) if self.weights[-1] > 0 else int((self.weights > 0).sum())


@dataclass(frozen=True)
class Plan:
    """How a global batch is cut: per-rank rows, micro-batch size, accumulation steps."""

    global_batch: int
    world_size: int
    micro_batch: int

    def __post_init__(self) -> None:
        per_rank, rem = divmod(self.global_batch, self.world_size)
        if rem or per_rank < 1:
            raise ConfigError(
                f"train.batch_size={self.global_batch} is not a multiple of the world size "
                f"{self.world_size}; pick a multiple of {self.world_size}"
            )
        if self.micro_batch < 1 or per_rank % self.micro_batch:
            raise ConfigError(
                f"train.micro_batch={self.micro_batch} does not divide the per-rank batch "
                f"{per_rank} (batch_size {self.global_batch} / world size {self.world_size}); "
                f"pick a divisor of {per_rank}"
            )

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.world_size

    @property
    def accumulation(self) -> int:
        return self.per_rank // self.micro_batch

    def halved(self) -> Plan:
        """The OOM back-off: half the micro-batch, twice the accumulation, same global batch."""
        return Plan(
            global_batch=self.global_batch,
            world_size=self.world_size,
            micro_batch=self.micro_batch // 2,
        )


def make_plan(
    batch_size: int, micro_batch: int | str, world_size: int, *, auto_micro_batch: int | None = None
) -> Plan:
    """`micro_batch=0` means the whole per-rank batch in one forward (no accumulation);
    `"auto"` takes `auto_micro_batch`, chosen by enn_core.runtime.batch_probe.choose_micro_batch."""
    if micro_batch == "auto":
        if auto_micro_batch is None:
            raise ConfigError(
                "train.micro_batch=auto was not resolved before planning (the worker calls "
                "enn_core.runtime.batch_probe.choose_micro_batch); "
                "set train.micro_batch to an integer"
            )
        micro_batch = auto_micro_batch
    per_rank = batch_size // max(world_size, 1)
    # TrainConfig admits no string but "auto", resolved above: an int from here on
    micro = cast(int, micro_batch)
    return Plan(global_batch=batch_size, world_size=world_size, micro_batch=micro or per_rank)


class GlobalBlockSampler:
    """Epoch orders over the training rows; `step_rows(epoch, step, rank)` gives a rank's slice."""

    def __init__(
        self, train_rows: np.ndarray, global_batch: int, *, seed: int, shuffle_block: int = 1
    ) -> None:
        if len(train_rows) == 0:
            raise ConfigError("the training split is empty; re-run stage-data with training rows")
        if shuffle_block < 1:
            raise ConfigError("train.shuffle_block must be >= 1")
        self.train_rows = np.asarray(train_rows, dtype=np.int64)
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle_block = shuffle_block
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.train_rows) / self.global_batch)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Staged row indices in this epoch's order (a permutation of the training rows)."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        n = len(self.train_rows)
        n_blocks = math.ceil(n / self.shuffle_block)
        rng = np.random.default_rng([self.seed, epoch])
        blocks = rng.permutation(n_blocks)
        starts = blocks * self.shuffle_block
        pos = (starts[:, None] + np.arange(self.shuffle_block)[None, :]).ravel()
        order = self.train_rows[pos[pos < n]]
        self._order_cache = (epoch, order)
        return order

    def step_rows(
        self, epoch: int, step: int, rank: int, world_size: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(rows, weights) of one rank's slice of global batch `step`; padding weighs zero.
        Every rank's slice has the same length: the full batch's share, and in a shorter last
        batch its real rows' share rounded up."""
        order = self.epoch_order(epoch)
        lo = step * self.global_batch
        rows = order[lo : lo + self.global_batch]
        size = -(-len(rows) // world_size) * world_size  # the last batch: a multiple of ranks
        weights = np.ones(size, dtype=np.float32)
        if len(rows) < size:  # pad with a real row at weight 0
            pad = size - len(rows)
            weights[len(rows) :] = 0.0
            rows = np.concatenate([rows, np.full(pad, order[0], dtype=np.int64)])
        per_rank = size // world_size
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        return rows[sl], weights[sl]

    def real_rows(self, epoch: int, step: int) -> int:
        """Real (non-padding) rows of global batch `step`: the loss divisor on every rank."""
        return int(min(self.global_batch, len(self.train_rows) - step * self.global_batch))

    def state(self, epoch: int, step: int) -> dict[str, int]:
        """The resumable position: global, so valid at any world size."""
        return {"epoch": epoch, "step": step, "seed": self.seed, "global_batch": self.global_batch}


@overload
def read_rows(
    features: np.ndarray, labels: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]: ...
@overload
def read_rows(features: np.ndarray, labels: None, rows: np.ndarray) -> tuple[np.ndarray, None]: ...
def read_rows(
    features: np.ndarray, labels: np.ndarray | None, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray | None]:
    """One vectorized gather from the memmaps (sorted reads, original order restored)."""
    order = np.argsort(rows, kind="stable")
    sorted_rows = rows[order]
    inv = np.empty_like(order)
    inv[order] = np.arange(len(order))
    x = np.asarray(features[sorted_rows], dtype=np.float32)[inv]
    y = None if labels is None else np.asarray(labels[sorted_rows], dtype=np.float32)[inv]
    return x, y


def micro_batches(
    features: np.ndarray,
    labels: np.ndarray,
    rows: np.ndarray,
    weights: np.ndarray,
    micro_batch: int,
) -> list[Batch]:
    """Cut a rank's slice into micro-batches, each read with one gather."""
    x, y = read_rows(features, labels, rows)
    out: list[Batch] = []
    for lo in range(0, len(rows), micro_batch):
        sl = slice(lo, lo + micro_batch)
        out.append(Batch(features=x[sl], labels=y[sl], weights=weights[sl], rows=rows[sl]))
    return out


def eval_slices(n_rows: int, batch: int, rank: int, world_size: int) -> list[tuple[int, int, int]]:
    """Validation: (start, stop, n_real) per forward for this rank; the same count on every rank.

    Rows are split in contiguous per-rank ranges; shorter ranks pad with weight-0 rows so every
    rank runs every FSDP forward (FIELD_NOTES: rank-0-only evaluation hangs)."""
    per_rank = math.ceil(n_rows / world_size)
    lo = min(rank * per_rank, n_rows)
    hi = min(lo + per_rank, n_rows)
    n_forwards = max(1, math.ceil(per_rank / batch))
    out = []
    for i in range(n_forwards):
        a = lo + i * batch
        b = min(a + batch, hi)
        out.append((a, max(a, b), max(0, b - a)))
    return out
