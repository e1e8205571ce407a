"""Baselines and the collapse measure, defined once (validate, collapse-check and the quality
report all use these).

- `cell_mean` / `cell_median`: the plain per-cell mean or median of the training labels.
- `ConditionalNaive`: the mean (or, with `statistic="median"`, the median) of the same cell
  over the training rows that share the declared key columns (e.g. day type and direction),
  falling back to the per-cell statistic for a key combination the training rows never had.
  For MAE the median is the best constant, for squared error the mean: validate scores both
  (enn_core.metrics).
- `group_statistic`: those statistics per group and cell over the rows of a staged memmap,
  read in chunks (validate's and collapse-check's naive predictors at any number of rows).
- `l1_ridge`: the fitted ridge baseline's absolute-error fit (enn_core.fitted_baselines),
  iteratively reweighted least squares whose normal equations come from the dense columns
  and a sparse one-hot (`Design`), never from each row's outer product (issue 51: 76 GiB at
  39,215 rows x 511 features).
- `spread_ratio` / `collapse_stats`: per output, the std across samples of the prediction
  over the std of the target; collapse = median ratio < 0.5 or 10th percentile < 0.3.

Key columns come from the staged `row_keys.parquet` (a DataFrame), a mapping name -> array,
or a 2-D array whose columns follow `key_names`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from enn_core.errors import DataError

if TYPE_CHECKING:
    import pandas as pd

    # Key columns: the staged row_keys DataFrame, a mapping name -> column, or a 2-D array.
    KeyColumns: TypeAlias = pd.DataFrame | Mapping[str, Sequence[object] | np.ndarray] | np.ndarray

MEDIAN_RATIO_MIN = 0.5
L1_ITERATIONS = 30  # the absolute-error ridge's reweighting steps
OUTER_CELLS = 4_000_000  # the absolute-error ridge: the rows' products held at once (numbers)
SPARSE_SHARE = 0.25  # the absolute-error ridge: a column non-zero in at most this share is sparse
# (done, total) of a fit in progress: the caller draws it (validate: a bar on a terminal)
Tick = Callable[[int, int], None]
P10_RATIO_MIN = 0.3
STATISTICS = ("mean", "median")
READ_CELLS = 2_000_000  # label numbers read at once when a statistic streams over the rows
RADIX_MAX = 1 << 24  # key combinations numbered by counting (beyond: by sorting)
STAT_BYTES = 256 * 2**20  # a median's values held at once (a block of cells, every row)


def _key_columns(keys: KeyColumns, key_names: Sequence[str], n: int) -> list[np.ndarray]:
    """The key columns, from a DataFrame, a mapping of columns or a 2-D array."""
    if isinstance(keys, np.ndarray):
        arr = keys.reshape(len(keys), -1)
        if arr.shape[1] != len(key_names):
            raise DataError(f"key array has {arr.shape[1]} columns but key_names={list(key_names)}")
        cols = [arr[:, j] for j in range(arr.shape[1])]
    else:
        available = list(keys.keys()) if isinstance(keys, Mapping) else list(keys.columns)
        missing = [k for k in key_names if k not in available]
        if missing:
            raise DataError(
                f"row keys lack columns {missing} (have {available}); "
                "fix data.naive_keys or re-run stage-data"
            )
        cols = [np.asarray(keys[k]) for k in key_names]
    if any(len(c) != n for c in cols):
        raise DataError(
            f"row keys have {len(cols[0]) if cols else 0} rows but labels/predictions have {n}"
        )
    return cols


def _key_rows(keys: KeyColumns, key_names: Sequence[str], n: int) -> list[tuple[Any, ...]]:
    """Rows of key values as tuples, from a DataFrame, a mapping of columns or a 2-D array."""
    cols = _key_columns(keys, key_names, n)
    return list(zip(*(c.tolist() for c in cols), strict=True)) if cols else [()] * n


def _factorized(column: np.ndarray) -> np.ndarray:
    """A column's values as codes 0.. (equal values, equal codes; a missing value -1)."""
    import pandas as pd

    return np.asarray(pd.factorize(np.asarray(column))[0], dtype=np.int64)


def group_codes(codes: Sequence[np.ndarray], n: int) -> tuple[np.ndarray, int]:
    """Each row's group, 0 .. groups - 1, from each key column's codes (-1: missing, a value of
    its own); and the number of groups. Memory: an integer or two a row (no sort while the
    key combinations number at most RADIX_MAX)."""
    combined = np.zeros(n, dtype=np.int64)
    span = 1  # the combined codes lie in [0, span)
    for c in codes:
        size = int(np.max(c, initial=-1)) + 2  # -1 (missing) .. max
        if span * size > RADIX_MAX:  # renumber the combinations seen so far: 0 .. k - 1
            combined, span = _renumbered(combined, span)
        combined *= size
        combined += c
        combined += 1
        span *= size
    return _renumbered(combined, span)


def _renumbered(codes: np.ndarray, span: int) -> tuple[np.ndarray, int]:
    """`codes` in [0, span) as 0 .. k - 1 (k: the values present), in the same order."""
    if span <= RADIX_MAX:
        present = np.bincount(codes, minlength=span) > 0
        number = np.cumsum(present) - 1
        return number[codes], int(present.sum())
    uniq, inverse = np.unique(codes, return_inverse=True)
    return inverse.reshape(-1), len(uniq)


def group_statistic(
    labels: np.ndarray,
    rows: np.ndarray,
    groups: np.ndarray | None,
    n_groups: int,
    statistic: str,
    chunk_rows: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The mean or the median of `labels[rows]` ([N, *shape], e.g. the staged memmap) per
    group (`groups`: the group of each of `rows`, 0 .. n_groups - 1; None: one group) and per
    cell: ([n_groups, cells] float64, NaN for a group without rows; each group's row count).
    `chunk_rows` (data.chunk_rows) caps the rows read at once.

    Read in chunks of rows: the mean keeps a sum per group and cell; the median (exact, as
    np.median) holds the values of a block of cells at a time, STAT_BYTES of them at most
    (one cell of 10^7 rows is 40 MB of float32)."""
    from scipy import sparse  # type: ignore[import-untyped]  # scipy ships no type stubs

    if statistic not in STATISTICS:
        raise ValueError(f"statistic={statistic!r}; use one of {sorted(STATISTICS)}")
    cells = int(np.prod(labels.shape[1:]))
    if groups is None:  # one group: every row
        n_groups, counts = 1, np.array([len(rows)])
    else:
        groups = np.asarray(groups)
        counts = np.bincount(groups, minlength=n_groups)
    step = max(1, min(READ_CELLS // max(cells, 1), chunk_rows or len(rows) or 1))
    out = np.full((n_groups, cells), np.nan)
    if statistic == "mean":
        sums = np.zeros((n_groups, cells))
        for a in range(0, len(rows), step):
            part = _read(labels, rows[a : a + step], cells)
            if groups is None or n_groups == 1:
                sums[0] += part.sum(axis=0)
            else:  # a [groups, rows] indicator times the rows' values: every group's sums
                member = groups[a : a + step]
                pick = sparse.csr_matrix(
                    (np.ones(len(member)), (member, np.arange(len(member)))),
                    (n_groups, len(member)),
                )
                sums += pick @ part
        seen = counts > 0
        out[seen] = sums[seen] / counts[seen, None]
        return out, counts
    dtype = np.float32 if labels.dtype == np.float32 else np.float64  # exact either way
    where: np.ndarray | None = None  # each row's place among its group's values
    if groups is not None and n_groups > 1:
        index = np.int32 if len(rows) < 2**31 else np.int64
        order = np.argsort(groups, kind="stable").astype(index)
        where = np.empty_like(order)
        where[order] = np.arange(len(order), dtype=index)
        del order
    starts = np.concatenate([[0], np.cumsum(counts)])
    block = max(1, STAT_BYTES // (np.dtype(dtype).itemsize * max(len(rows), 1)))
    for c0 in range(0, cells, block):
        c1 = min(c0 + block, cells)
        values = np.empty((c1 - c0, len(rows)), dtype=dtype)
        for a in range(0, len(rows), step):
            part = _read(labels, rows[a : a + step], cells, dtype)
            at = slice(a, a + len(part)) if where is None else where[a : a + step]
            values[:, at] = part[:, c0:c1].T
        for g in np.flatnonzero(counts):
            lane = values[:, starts[g] : starts[g + 1]]
            lo, hi = (counts[g] - 1) // 2, counts[g] // 2
            lane.partition((lo, hi) if lo != hi else lo, axis=1)
            middle = (lane[:, lo].astype(np.float64) + lane[:, hi]) / 2  # as np.median
            out[g, c0:c1] = np.where(np.isnan(lane).any(axis=1), np.nan, middle)
    return out, counts


def _read(labels: np.ndarray, rows: np.ndarray, cells: int, dtype: Any = np.float64) -> np.ndarray:
    return np.asarray(labels[np.asarray(rows)], dtype=dtype).reshape(-1, cells)


def _whole(labels: np.ndarray, statistic: str) -> np.ndarray:
    """The statistic of every row, per cell: [N, *shape] -> [*shape] (float64)."""
    labels = np.asarray(labels)
    n = len(labels)
    one = group_statistic(labels, np.arange(n), None, 1, statistic)[0]
    return one[0].reshape(labels.shape[1:])


def cell_mean(labels: np.ndarray) -> np.ndarray:
    """Per-cell mean over rows: [N, *shape] -> [*shape] (float64)."""
    if len(labels) == 0:
        raise DataError("cell_mean needs at least one training row")
    return _whole(labels, "mean")


def cell_median(labels: np.ndarray) -> np.ndarray:
    """Per-cell median over rows: [N, *shape] -> [*shape] (float64)."""
    if len(labels) == 0:
        raise DataError("cell_median needs at least one training row")
    return _whole(labels, "median")


def per_cell_mean_predict(train_labels: np.ndarray, n: int) -> np.ndarray:
    """The per-cell mean repeated for `n` rows: [n, *shape]."""
    m = cell_mean(train_labels)
    return np.broadcast_to(m, (n, *m.shape)).copy()


def per_cell_median_predict(train_labels: np.ndarray, n: int) -> np.ndarray:
    """The per-cell median repeated for `n` rows: [n, *shape] (the best constant for MAE)."""
    m = cell_median(train_labels)
    return np.broadcast_to(m, (n, *m.shape)).copy()


class ConditionalNaive:
    """Mean (or median) of the same cell over training rows sharing `key_names`; the per-cell
    mean (or median) otherwise."""

    def __init__(self, key_names: Sequence[str], statistic: str = "mean") -> None:
        if statistic not in STATISTICS:
            raise ValueError(f"statistic={statistic!r}; use one of {sorted(STATISTICS)}")
        self.key_names = tuple(key_names)
        self.statistic = statistic
        self.group_means: dict[tuple[Any, ...], np.ndarray] = {}  # the statistic per group
        self.fallback: np.ndarray | None = None

    def fit(self, labels: np.ndarray, keys: KeyColumns) -> ConditionalNaive:
        labels = np.asarray(labels)
        n = len(labels)
        cols = _key_columns(keys, self.key_names, n)
        codes, n_groups = group_codes([_factorized(c) for c in cols], n)
        stat, counts = group_statistic(labels, np.arange(n), codes, n_groups, self.statistic)
        self.fallback = _whole(labels, self.statistic)
        first = np.unique(codes, return_index=True)[1]
        shape = self.fallback.shape
        self.group_means = {
            tuple(c[i : i + 1].tolist()[0] for c in cols): stat[g].reshape(shape)
            for g, i in enumerate(first)
            if counts[g]
        }
        return self

    def predict(self, keys: KeyColumns, n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(predictions [n, *shape], fell_back [n] bool: key combination unseen in training)."""
        if self.fallback is None:
            raise RuntimeError("ConditionalNaive.predict before fit")
        if n is None:
            n = len(keys) if not isinstance(keys, Mapping) else len(next(iter(keys.values())))
        rows = _key_rows(keys, self.key_names, n)
        out = np.empty((n, *self.fallback.shape))
        fell_back = np.zeros(n, dtype=bool)
        for i, r in enumerate(rows):
            m = self.group_means.get(r)
            fell_back[i] = m is None
            out[i] = self.fallback if m is None else m
        return out, fell_back


def conditional_naive_predict(
    train_labels: np.ndarray,
    train_keys: KeyColumns,
    eval_keys: KeyColumns,
    key_names: Sequence[str],
    n_eval: int | None = None,
    statistic: str = "mean",
) -> np.ndarray:
    """One call: fit on the training rows, predict the evaluation rows."""
    naive = ConditionalNaive(key_names, statistic).fit(train_labels, train_keys)
    return naive.predict(eval_keys, n_eval)[0]


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
        from scipy import sparse

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


def regression_errors(pred: np.ndarray, target: np.ndarray) -> dict[str, float]:
    """MAE and RMSE over all cells (real units in, real units out)."""
    diff = np.asarray(pred, dtype=np.float64) - np.asarray(target, dtype=np.float64)
    return {"mae": float(np.abs(diff).mean()), "rmse": float(np.sqrt((diff**2).mean()))}


def spread_ratio(pred: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per output: std across samples of pred / std of target (NaN where the target is flat)."""
    pred = np.asarray(pred, dtype=np.float64)
    target = np.asarray(target, dtype=np.float64)
    if pred.shape != target.shape or pred.ndim < 1 or len(pred) < 2:
        raise DataError(
            "spread_ratio needs pred and target of the same shape with >= 2 rows; "
            f"got {pred.shape} and {target.shape}"
        )
    ps = pred.reshape(len(pred), -1).std(axis=0)
    ts = target.reshape(len(target), -1).std(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ts > 0, ps / np.where(ts > 0, ts, 1.0), np.nan)


def collapse_stats(
    pred: np.ndarray,
    target: np.ndarray,
    median_min: float = MEDIAN_RATIO_MIN,
    p10_min: float = P10_RATIO_MIN,
) -> dict[str, Any]:
    """{median_ratio, p10_ratio, collapsed, n_outputs, n_flat_targets}:
    collapse = median < median_min or p10 < p10_min."""
    ratio = spread_ratio(pred, target)
    valid = ratio[np.isfinite(ratio)]
    if valid.size == 0:
        raise DataError(
            "collapse_stats: every target output is constant across samples; "
            "the spread ratio is undefined"
        )
    median, p10 = float(np.median(valid)), float(np.percentile(valid, 10))
    return {
        "median_ratio": median,
        "p10_ratio": p10,
        "collapsed": bool(median < median_min or p10 < p10_min),
        "median_min": median_min,
        "p10_min": p10_min,
        "n_outputs": int(ratio.size),
        "n_flat_targets": int(ratio.size - valid.size),
    }
