"""Seeded splits, group-aware folds, and train-row statistics, in streaming passes.

Each row gets a split code, kept in a temporary int8 file: a row whose fold key value lies
in the test (or validation) fold is fixed there; the rest form a pool. Random splits draw
exact counts from the pool block by block (a hypergeometric count per block, then a uniform
choice inside it), so memory stays at one block whatever the row count and the result
depends only on the seed and the rows, not on data.chunk_rows. When the row count is known
up front (arrays, Parquet, workbook, synthetic) rows are assigned, and train-row statistics
accumulated, while they are staged; otherwise (CSV, folds with a random validation share)
a pass after staging does it. A last pass writes `splits/<name>.npy`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import cast

import numpy as np

from enn_core.config import DataConfig
from enn_core.data.encode import value_key
from enn_core.data.npyio import NpyWriter
from enn_core.data.sources import Coded, Column
from enn_core.errors import DataError

TRAIN, VAL, TEST = 0, 1, 2
NAMES = ("train", "val", "test")
BLOCK = 1 << 16  # rows per sampling block: fixed so splits do not depend on chunk_rows


def fold_codes(cfg: DataConfig, keys: Mapping[str, Column], n: int, file: str) -> np.ndarray:
    """Split code per row from the declared folds (TRAIN = pool for random sampling)."""
    codes = np.zeros(n, np.int8)
    if not cfg.folds:
        return codes
    if cfg.fold_key not in keys:
        raise DataError(
            f"{file}: data.fold_key {cfg.fold_key!r} is not a row key of the input "
            f"({sorted(keys)}); fix it"
        )
    test = {value_key(v) for v in cfg.folds[cfg.test_fold]}
    val = val_values(cfg)
    col = keys[cfg.fold_key]
    if isinstance(col, Coded):  # each level spelled once; a missing value reads "nan"
        spelled = np.array([value_key(v) for v in col.levels] + ["nan"], dtype=object)
        vals = spelled[np.where(col.codes < 0, len(col.levels), col.codes)]
    else:
        vals = np.array([value_key(v) for v in col], dtype=object)
    codes[np.isin(vals, list(test))] = TEST
    codes[np.isin(vals, list(val))] = VAL
    return codes


def val_values(cfg: DataConfig) -> set[str]:
    """The fold_key values held out for validation: the val_fold's, or with data.val_by_key a
    seeded val_fraction share (at least one) of the training folds' values."""
    if cfg.val_fold >= 0:
        return {value_key(v) for v in cfg.folds[cfg.val_fold]}
    if not (cfg.folds and cfg.val_by_key):
        return set()
    pool = sorted(
        {value_key(v) for i, fold in enumerate(cfg.folds) if i != cfg.test_fold for v in fold}
    )
    k = min(len(pool) - 1, max(1, int(round(cfg.val_fraction * len(pool)))))
    rng = np.random.default_rng([cfg.split_seed, 2])
    return {pool[j] for j in rng.choice(len(pool), k, replace=False)}


class _Draw:
    """Exact seeded draw of k of the `pool` TRAIN rows, visited block by block in row order."""

    def __init__(self, k: int, pool: int, new: int, rng: np.random.Generator) -> None:
        self.k, self.pool, self.new, self.rng = k, pool, new, rng

    def block(self, codes: np.ndarray) -> None:
        idx = np.flatnonzero(codes == TRAIN)
        c = len(idx)
        if c == 0 or self.k == 0:
            self.pool -= c
            return
        m = (
            c
            if self.pool <= self.k
            else int(self.rng.hypergeometric(self.k, self.pool - self.k, c))
        )
        if m:
            codes[idx[self.rng.choice(c, m, replace=False)]] = self.new
        self.pool -= c
        self.k -= m


class Splits:
    """Random test/val assignment over rows in order, BLOCK rows at a time.

    `n_pool` is the number of rows not fixed by folds (all rows without folds).
    The same blocks and draws run whether rows are assigned while staging (`take`) or after
    (`assign_file`), so both give the same splits.
    """

    def __init__(self, cfg: DataConfig, n_rows: int, n_pool: int | None = None) -> None:
        self.draws: list[_Draw] = []
        k_test = 0
        if not cfg.folds:
            k_test = int(round(cfg.test_fraction * n_rows))
            self.draws.append(
                _Draw(k_test, n_rows, TEST, np.random.default_rng([cfg.split_seed, 0]))
            )
        if cfg.val_fold < 0 and not (cfg.folds and cfg.val_by_key):
            pool = (n_rows if n_pool is None else n_pool) - k_test
            k_val = int(round(cfg.val_fraction * pool))
            self.draws.append(_Draw(k_val, pool, VAL, np.random.default_rng([cfg.split_seed, 1])))
        self.n, self.done = n_rows, 0
        self._buf = np.zeros(0, np.int8)

    def block(self, codes: np.ndarray) -> None:
        for d in self.draws:
            d.block(codes)

    def take(self, n: int) -> np.ndarray:
        """Codes of the next n rows (random splits without folds, rows known up front)."""
        while len(self._buf) < n:
            blk = np.zeros(min(BLOCK, self.n - self.done), np.int8)
            if len(blk) == 0:
                raise ValueError("more rows than announced")
            self.block(blk)
            self.done += len(blk)
            self._buf = np.concatenate([self._buf, blk])
        out, self._buf = self._buf[:n], self._buf[n:]
        return out


def streaming(cfg: DataConfig, n_rows: int | None) -> Splits | None:
    """A Splits assigning rows while they are staged, when nothing needs a full pass first."""
    val_drawn = cfg.folds and cfg.val_fold < 0 and not cfg.val_by_key  # needs the pool size
    if n_rows is None or cfg.features_only or val_drawn:
        return None
    return Splits(cfg, n_rows)


def assign_file(cfg: DataConfig, codes: np.ndarray) -> None:
    """Fill in random splits after staging (codes: the writable per-row fold codes)."""
    s = Splits(cfg, len(codes), int(np.count_nonzero(codes == TRAIN)))
    for i in range(0, len(codes), BLOCK):
        s.block(codes[i : i + BLOCK])


class Moments:
    """Per-column mean and variance of float32/64 rows, accumulated in float64.

    Sums of (x - shift) and its square, with the shift taken from the first row seen, so a
    large offset does not cancel away the variance.
    """

    def __init__(self, width: int) -> None:
        self.n = 0
        self.shift: np.ndarray | None = None
        self.s1 = np.zeros(width, np.float64)
        self.s2 = np.zeros(width, np.float64)

    def add(self, x: np.ndarray) -> None:
        if x.shape[0] == 0:
            return
        if self.shift is None:
            self.shift = x[0].astype(np.float64)
        d = x - self.shift.astype(x.dtype)
        self.s1 += np.add.reduce(d, axis=0, dtype=np.float64)
        self.s2 += np.einsum("ij,ij->j", d, d, dtype=np.float64)
        self.n += x.shape[0]

    @property
    def mean(self) -> np.ndarray:
        shift = self.shift if self.shift is not None else 0.0
        return shift + self.s1 / max(self.n, 1)

    def std(self) -> np.ndarray:
        m = self.s1 / max(self.n, 1)
        return np.sqrt(np.maximum(self.s2 / max(self.n, 1) - m * m, 0.0))


def accumulate(
    fx: Moments,
    fy: Moments | None,
    x: np.ndarray,
    y: np.ndarray | None,
    rows: np.ndarray,
    cont: list[int],
) -> None:
    """Add train `rows` of x (continuous columns) and y, in sub-blocks of about 1 MB."""
    width = max(x.shape[1], 1 if y is None else int(np.prod(y.shape[1:])))
    step = max(1, (1 << 20) // (8 * width))
    all_cont = cont == list(range(x.shape[1]))
    for t in range(0, len(rows), step):
        r = rows[t : t + step]
        if cont:
            xb = x[r]
            fx.add(xb if all_cont else xb[:, cont])
        if fy is not None:  # given with the labels y
            fy.add(cast(np.ndarray, y)[r].reshape(-1, 1))


def finish(
    out: Path,
    codes: np.ndarray,
    features: np.ndarray,
    labels: np.ndarray | None,
    stats: tuple[Moments, Moments | None, list[int]] | None,
    need_train: bool = True,
) -> tuple[dict[str, int], dict[str, str]]:
    """Write splits/<name>.npy (and, when `stats` = (fx, fy, cont), accumulate train rows)."""
    (out / "splits").mkdir()
    writers = [NpyWriter(out / "splits" / f"{name}.npy", np.int64, ()) for name in NAMES]
    for s in range(0, len(codes), BLOCK):
        blk = np.asarray(codes[s : s + BLOCK])
        for code, w in enumerate(writers):
            w.write(np.flatnonzero(blk == code) + s)
        if stats is not None:
            fx, fy, cont = stats
            accumulate(fx, fy, features, labels, np.flatnonzero(blk == TRAIN) + s, cont)
    hashes = {f"splits/{name}.npy": w.close() for name, w in zip(NAMES, writers, strict=True)}
    sizes = {name: w.rows for name, w in zip(NAMES, writers, strict=True)}
    if need_train and sizes["train"] == 0:
        raise DataError(
            f"{out.name}: no training rows are left after the splits; "
            "fix data.folds or the fractions"
        )
    return sizes, hashes
