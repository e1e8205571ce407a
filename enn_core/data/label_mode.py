"""A label that is mostly one value: per output, the value that holds more than half of the
rows (a count that is zero on most days), read in chunks so that 10^7 rows stay in bounded
memory.

    mode = label_mode(ds.targets, ds.split("train"), cfg.data.chunk_rows)
    mode.mostly_one_value, mode.top_value, mode.top_share   # e.g. True, 0.0, 0.68

Under MAE the best constant for such an output is that value (the median), so a model that
predicts near it scores well while its spread is small: collapse-check's verdict and
`enn doctor`'s `data labels` line read this (docs/your-data.md, "A label that is mostly one
value").

Exact for any value holding more than half of an output: a majority vote over the chunks (each
chunk's majority, its median where it has one, votes with its surplus; the votes merge as one
Misra-Gries counter does), then a second pass counts the winner. Where no value holds more than
half, the share reported is at most 0.5 and names no particular value.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from enn_core.errors import DataError

MOSTLY_ONE_VALUE = 0.5  # an output is mostly one value when that value holds more than this
MODE_CHUNK_CELLS = 2_000_000  # label numbers read at once


@dataclass(frozen=True)
class LabelMode:
    """Per output (label cells flattened in C order): the majority value (NaN or any value
    where there is none) and its share of the rows measured."""

    values: np.ndarray
    shares: np.ndarray
    n_rows: int

    @property
    def mostly(self) -> np.ndarray:
        """Which outputs are mostly one value."""
        return self.shares > MOSTLY_ONE_VALUE

    @property
    def n_mostly(self) -> int:
        return int(self.mostly.sum())

    @property
    def mostly_one_value(self) -> bool:
        """At least half of the outputs are mostly one value (the median output is)."""
        return bool(self.shares.size) and 2 * self.n_mostly >= self.shares.size

    @property
    def top(self) -> int:
        """The output whose majority value holds the largest share."""
        return int(np.argmax(self.shares))

    @property
    def top_value(self) -> float:
        return float(self.values[self.top])

    @property
    def top_share(self) -> float:
        return float(self.shares[self.top])


def label_mode(
    labels: np.ndarray, rows: np.ndarray | None = None, chunk_rows: int | None = None
) -> LabelMode:
    """The majority value of each output of `labels` [N, ...] (a memmap), over its rows `rows`
    (sorted indices; all rows without), read at most `chunk_rows` rows (data.chunk_rows) and
    MODE_CHUNK_CELLS numbers at a time."""
    n = len(labels) if rows is None else len(rows)
    if n == 0:
        raise DataError("no training rows to measure the labels on; re-run stage-data")
    cells = max(1, int(np.prod(labels.shape[1:], dtype=np.int64)))
    cap = max(1, MODE_CHUNK_CELLS // cells)
    step = min(cap, chunk_rows or cap)

    def chunks() -> Iterator[np.ndarray]:
        for start in range(0, n, step):
            part = (
                labels[start : start + step] if rows is None else labels[rows[start : start + step]]
            )
            yield np.asarray(part).reshape(-1, cells)

    value = np.full(cells, np.nan)
    votes = np.zeros(cells, dtype=np.int64)
    for c in chunks():
        k = len(c) // 2  # a value holding more than half of a column covers its sorted middle
        middle = np.partition(c, k, axis=0)[k].astype(np.float64)
        surplus = np.maximum(2 * (c == middle).sum(axis=0) - len(c), 0)
        same = value == middle
        keep = same | (votes >= surplus)
        votes = np.where(same, votes + surplus, np.abs(votes - surplus))
        value = np.where(keep, value, middle)
    count = np.zeros(cells, dtype=np.int64)
    for c in chunks():
        count += (c == value).sum(axis=0)
    return LabelMode(values=value, shares=count / n, n_rows=n)


def output_name(
    index: int,
    shape: Sequence[int],
    axes: Sequence[str] = (),
    axis_values: Mapping[str, Sequence[object]] | None = None,
) -> str:
    """The name of flattened output `index`: its axis values joined by '|' (a table's label
    column on one axis), or axis name and position where the manifest names no values."""
    if not shape:
        return "y"
    parts = []
    for i, pos in enumerate(np.unravel_index(index, tuple(shape))):
        axis = axes[i] if i < len(axes) else f"y{i}"
        values = list((axis_values or {}).get(axis) or [])
        parts.append(str(values[pos]) if len(values) == shape[i] else f"{axis}{pos}")
    return "|".join(parts)
