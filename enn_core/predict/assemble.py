"""Assembly of completed parts into one predictions array, by row id.

Every part carries the row ids it holds; assembly scatters each part to its rows and checks
that every row id in [0, n_rows) appears exactly once, so a missing part, a part from an
overlapping plan or a stray file is an error that names the rows, never a silent gap.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from enn_core.errors import DataError
from enn_core.predict.chunks import PartStore


def _describe(ids: np.ndarray, limit: int = 5) -> str:
    shown = ", ".join(str(int(i)) for i in ids[:limit])
    return f"{len(ids)} rows ({shown}{', ...' if len(ids) > limit else ''})"


def check_range(ids: np.ndarray, n_rows: int, where: str | Path) -> None:
    """Raise DataError when a part holds row ids outside [0, n_rows)."""
    bad = ids[(ids < 0) | (ids >= n_rows)]
    if len(bad):
        raise DataError(
            f"{where}: parts hold row ids outside [0, {n_rows}): {_describe(bad)}; re-run predict"
        )


def check_coverage(row_ids: list[np.ndarray], n_rows: int, where: str | Path) -> None:
    """Raise DataError unless the row ids cover [0, n_rows) exactly once."""
    all_ids = np.concatenate(row_ids) if row_ids else np.zeros(0, dtype=np.int64)
    check_range(all_ids, n_rows, where)
    counts = np.bincount(all_ids, minlength=n_rows)
    missing = np.flatnonzero(counts == 0)
    if len(missing):
        raise DataError(f"{where}: {_describe(missing)} missing from the parts; re-run predict")
    dup = np.flatnonzero(counts > 1)
    if len(dup):
        raise DataError(
            f"{where}: {_describe(dup)} appear in more than one part; "
            f"delete {where} and re-run predict"
        )


def assemble(store: PartStore, target: str | Path) -> np.ndarray:
    """Write all parts of `store` into a new `.npy` at `target` (row order) and return it mapped.

    The caller owns atomicity: `target` lives in an `atomic_dir` temporary directory.
    """
    plan = store.plan
    out = np.lib.format.open_memmap(
        Path(target), mode="w+", dtype=np.dtype(plan.dtype), shape=(plan.n_rows, *plan.out_shape)
    )
    seen: list[np.ndarray] = []
    for k in range(plan.n_parts):  # each part read once, checked, then copied (one in memory)
        rows, preds = store.read_part(k)
        check_range(rows, plan.n_rows, store.root)
        seen.append(rows)
        if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and np.all(np.diff(rows) == 1):
            out[rows[0] : rows[-1] + 1] = preds  # contiguous: one block copy
        else:
            out[np.asarray(rows)] = preds
    check_coverage(seen, plan.n_rows, store.root)
    out.flush()
    return np.load(Path(target), mmap_mode="r")
