"""validate's ridge baseline towards least absolute deviations (enn_core.fitted_baselines'
`ridge` with the absolute-error loss): iteratively reweighted least squares from the
least-squares fit, each output's normal equations built without any row's outer product.

A 3-million-row table with a 500-level categorical asked for 76.3 GiB here (issue 51: each of
39,215 kept rows' [511, 511] outer product at once). `Design` keeps the mostly-non-zero
columns (the intercept, z-scored numbers, sin and cos) as an array and the mostly-zero ones
(one-hot) as a sparse matrix, so the memory is the rows' features once, the products of a
chunk of rows' non-zeros (OUTER_CELLS) and outputs x features^2 numbers for the equations,
what fitted_baselines.L1_CELLS bounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

L1_ITERATIONS = 30  # ridge's reweighting steps towards least absolute deviations
OUTER_CELLS = 4_000_000  # the rows' products held at once (numbers)
SPARSE_SHARE = 0.25  # a column non-zero in at most this share of the rows is kept sparse

# (done, total) of the fit in progress: the caller draws it (validate: a bar on a terminal)
Tick = Callable[[int, int], None]


def l1_ridge(
    x: np.ndarray, y: np.ndarray, alpha: float, start: np.ndarray, deadline: float, tick: Tick
) -> tuple[np.ndarray, int]:
    """Ridge towards least absolute deviations, one per output column: iteratively reweighted
    least squares (weights 1 / |residual|, floored), the intercept unpenalized, the penalty
    rescaled from squared to absolute error by the least-squares fit's median |residual|.
    Returns ([1 + features, outputs] like `start`, the least-squares fit it starts from; the
    reweighting steps run: fewer than L1_ITERATIONS when the next would pass `deadline`).

    Each output's normal equations X' W_k X are built without any row's outer product
    [d, d] (39,215 rows x 511 x 511 asked for 76 GiB): `Design` keeps the dense columns as
    an array and the one-hot ones sparse, so the memory is the rows' features once and
    outputs x features^2 numbers, what L1_CELLS bounds."""
    design = Design(x)
    coef = start.copy()
    resid = np.abs(y - design.predict(coef))
    scale = max(float(np.median(resid)), 1e-12)
    penalty = np.eye(design.d) * alpha / scale
    penalty[0, 0] = 0.0
    step_s = 0.0
    for done in range(L1_ITERATIONS):
        if time.perf_counter() + step_s > deadline:
            return coef, done
        s0 = time.perf_counter()
        w = 1.0 / np.maximum(resid, 1e-3 * scale)  # [n, outputs]
        gram = design.gram(w)  # [d * d, outputs]
        rhs = design.rhs(w * y)  # [d, outputs]
        for k in range(y.shape[1]):
            coef[:, k] = np.linalg.solve(
                gram[:, k].reshape(design.d, design.d) + penalty, rhs[:, k]
            )
        del gram
        resid = np.abs(y - design.predict(coef))
        step_s = time.perf_counter() - s0
        tick(done + 1, L1_ITERATIONS)
    return coef, L1_ITERATIONS


class Design:
    """The design [1, x] of the absolute-error ridge, split by columns: `dense` (the intercept
    and every column that is mostly non-zero: z-scored numbers, sin and cos) as an array,
    `onehot` (the mostly-zero columns: one-hot categoricals) as a CSR matrix."""

    def __init__(self, x: np.ndarray) -> None:
        from scipy import sparse  # type: ignore[import-untyped]  # scipy ships no type stubs

        n = len(x)
        self.n, self.d = n, x.shape[1] + 1
        share = np.count_nonzero(x, axis=0) / max(n, 1)
        self.scols = np.flatnonzero(share <= SPARSE_SHARE) + 1  # positions in [1, x]
        self.dcols = np.concatenate([[0], np.flatnonzero(share > SPARSE_SHARE) + 1])
        self.dense = np.column_stack([np.ones(n), x[:, self.dcols[1:] - 1]])
        step = max(1, OUTER_CELLS // max(len(self.scols), 1))
        self.onehot = sparse.vstack(
            [sparse.csr_matrix(x[a : a + step, self.scols - 1]) for a in range(0, max(n, 1), step)],
            format="csr",
        )
        nd, per_row = len(self.dcols), int(np.diff(self.onehot.indptr).max(initial=0))
        # rows whose products are held at once: a row adds nd^2 dense products and, per
        # non-zero of its sparse columns, one with each dense column (twice) and each non-zero
        self.chunk = max(1, OUTER_CELLS // (nd * nd + per_row * (2 * nd + per_row)))
        self.dd = (self.dcols[:, None] * self.d + self.dcols[None, :]).reshape(-1)
        self._kept: list[tuple[np.ndarray, Any]] | None = None

    def predict(self, coef: np.ndarray) -> np.ndarray:
        """[n, outputs]: the design times `coef` [1 + features, outputs]."""
        return self.dense @ coef[self.dcols] + self.onehot @ coef[self.scols]

    def rhs(self, wy: np.ndarray) -> np.ndarray:
        """[d, outputs]: X' (w * y), a column per output."""
        out = np.empty((self.d, wy.shape[1]))
        out[self.dcols] = self.dense.T @ wy
        out[self.scols] = self.onehot.T @ wy
        return out

    def gram(self, w: np.ndarray) -> np.ndarray:
        """[d * d, outputs]: X' diag(w[:, k]) X flattened, a column per output k, summed over
        row chunks of the rows' products (kept when one chunk holds every row)."""
        flat: np.ndarray | None = None
        for a, (outer, pairs) in self._chunks():
            part = w[a : a + len(outer)]
            if flat is None:
                flat = np.asarray(pairs @ part)
            else:
                flat += pairs @ part
            flat[self.dd] += (part.T @ outer).T
        assert flat is not None  # at least one row
        return flat

    def _chunks(self) -> Iterator[tuple[int, tuple[np.ndarray, Any]]]:
        if self._kept is not None:
            yield 0, self._kept[0]
            return
        for a in range(0, self.n, self.chunk):
            made = self._products(a, min(a + self.chunk, self.n))
            if self.chunk >= self.n:
                self._kept = [made]
            yield a, made

    def _products(self, a: int, b: int) -> tuple[np.ndarray, Any]:
        """Rows a..b's products: the dense columns' [rows, nd*nd], and the sparse columns' (with
        each other and with the dense ones) as a sparse [d*d, rows] matrix."""
        from scipy import sparse

        dense, part = self.dense[a:b], self.onehot[a:b]
        rows, nd = b - a, len(self.dcols)
        outer = (dense[:, :, None] * dense[:, None, :]).reshape(rows, nd * nd)
        counts = np.diff(part.indptr)
        row = np.repeat(np.arange(rows), counts)  # each non-zero's row
        col = self.scols[part.indices]  # and its position in [1, x]
        # every pair of non-zeros of a row
        reps = counts[row]
        left = np.repeat(np.arange(len(row)), reps)
        within = np.arange(len(left)) - np.repeat(np.cumsum(reps) - reps, reps)
        right = part.indptr[row[left]] + within
        # each non-zero with each dense column, both ways round
        e = np.repeat(np.arange(len(row)), nd)
        k = np.tile(np.arange(nd), len(row))
        cross = part.data[e] * dense[row[e], k]
        index = np.concatenate(
            [
                col[left] * self.d + col[right],
                col[e] * self.d + self.dcols[k],
                self.dcols[k] * self.d + col[e],
            ]
        )
        value = np.concatenate([part.data[left] * part.data[right], cross, cross])
        which = np.concatenate([row[left], row[e], row[e]])
        pairs = sparse.csr_matrix((value, (index, which)), shape=(self.d * self.d, rows))
        return outer, pairs
