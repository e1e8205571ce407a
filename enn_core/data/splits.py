"""Seeded splits, group-aware folds, and train-row statistics, all in one streaming pass.

While rows are written, each gets a split code in a temporary int8 file: a row whose fold
key value lies in the test (or validation) fold is fixed there; the rest form a pool. Random
splits then draw exact counts from the pool block by block (a hypergeometric count per
block, then a uniform choice inside it), so memory stays at one block whatever the row count
and the result depends only on the seed and the rows, not on data.chunk_rows. A last pass
writes `splits/<name>.npy` and accumulates float64 scaler statistics over train rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from enn_core.config import DataConfig
from enn_core.data.encode import value_key
from enn_core.data.npyio import NpyWriter
from enn_core.errors import DataError

TRAIN, VAL, TEST = 0, 1, 2
NAMES = ("train", "val", "test")
BLOCK = 1 << 16  # rows per sampling block: fixed so splits do not depend on chunk_rows


def fold_codes(cfg: DataConfig, keys: dict[str, np.ndarray], n: int, file: str) -> np.ndarray:
    """Split code per row from the declared folds (TRAIN = pool for random sampling)."""
    codes = np.zeros(n, np.int8)
    if not cfg.folds:
        return codes
    if cfg.fold_key not in keys:
        raise DataError(
            f"{file}: data.fold_key {cfg.fold_key!r} is not a row key of the input ({sorted(keys)}); fix it"
        )
    test = {value_key(v) for v in cfg.folds[cfg.test_fold]}
    val = {value_key(v) for v in cfg.folds[cfg.val_fold]} if cfg.val_fold >= 0 else set()
    vals = np.array([value_key(v) for v in keys[cfg.fold_key]], dtype=object)
    codes[np.isin(vals, list(test))] = TEST
    codes[np.isin(vals, list(val))] = VAL
    return codes


def _draw(codes: np.ndarray, k: int, new: int, rng: np.random.Generator) -> None:
    """Move exactly k uniformly chosen TRAIN rows of `codes` (a writable memmap) to `new`."""
    pool = int(np.count_nonzero(codes == TRAIN))
    for s in range(0, len(codes), BLOCK):
        if k == 0:
            break
        blk = codes[s : s + BLOCK]
        idx = np.flatnonzero(blk == TRAIN)
        c = len(idx)
        if c == 0:
            continue
        m = c if pool == k else int(rng.hypergeometric(k, pool - k, c))
        if m:
            blk[idx[rng.choice(c, m, replace=False)]] = new
        pool -= c
        k -= m


def assign(cfg: DataConfig, codes: np.ndarray) -> None:
    """Fill in random splits (test without folds, val without a val fold), seeded."""
    rng = np.random.default_rng(cfg.split_seed)
    n = len(codes)
    if not cfg.folds:
        _draw(codes, int(round(cfg.test_fraction * n)), TEST, rng)
    if cfg.val_fold < 0:
        pool = int(np.count_nonzero(codes == TRAIN))
        _draw(codes, int(round(cfg.val_fraction * pool)), VAL, rng)


class Moments:
    """Per-column mean and variance, merged chunk by chunk in float64 (Chan et al.)."""

    def __init__(self, width: int) -> None:
        self.n = 0
        self.mean = np.zeros(width, np.float64)
        self.m2 = np.zeros(width, np.float64)

    def add(self, x: np.ndarray) -> None:
        if x.shape[0] == 0:
            return
        x = x.astype(np.float64, copy=False)
        nb = x.shape[0]
        mb = x.mean(axis=0)
        d = x - mb
        m2b = np.einsum("ij,ij->j", d, d)
        n = self.n + nb
        delta = mb - self.mean
        self.mean = self.mean + delta * (nb / n)
        self.m2 = self.m2 + m2b + delta**2 * (self.n * nb / n)
        self.n = n

    def std(self) -> np.ndarray:
        return np.sqrt(self.m2 / max(self.n, 1))


def finish(
    out: Path, codes: np.ndarray, features: np.ndarray, labels: np.ndarray | None, cont: list[int]
) -> tuple[dict[str, int], dict[str, str], Moments, Moments | None]:
    """Write splits/<name>.npy; return sizes, data hashes and train-row moments."""
    (out / "splits").mkdir()
    writers = [NpyWriter(out / "splits" / f"{name}.npy", np.int64, ()) for name in NAMES]
    fx = Moments(len(cont))
    fy = Moments(1) if labels is not None else None
    all_cont = cont == list(range(features.shape[1]))
    # stats sub-blocks bounded to ~1 MB of float64 whatever the width (temporaries are a few x that)
    width = max(features.shape[1], 1 if labels is None else int(np.prod(labels.shape[1:])))
    step = max(1, min(BLOCK, (1 << 20) // (8 * width)))
    for s in range(0, len(codes), BLOCK):
        blk = np.asarray(codes[s : s + BLOCK])
        for code, w in enumerate(writers):
            w.write(np.flatnonzero(blk == code) + s)
        for t in range(0, len(blk), step):
            train = np.flatnonzero(blk[t : t + step] == TRAIN) + (s + t)
            if not train.size:
                continue
            if cont:
                x = features[train]
                fx.add(x if all_cont else x[:, cont])
            if fy is not None:
                fy.add(labels[train].reshape(-1, 1))
    hashes = {f"splits/{name}.npy": w.close() for name, w in zip(NAMES, writers, strict=True)}
    sizes = {name: w.rows for name, w in zip(NAMES, writers, strict=True)}
    if sizes["train"] == 0:
        raise DataError(
            f"{out.name}: no training rows are left after the splits; fix data.folds or the fractions"
        )
    return sizes, hashes, fx, fy
