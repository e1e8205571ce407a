"""The streaming write pass of stage-data: chunk in, checked rows out.

Per chunk: encode the features, find non-finite values (error naming the first bad row and
column, or drop those rows), append features, labels, row keys and split codes. float32 is
the staged dtype unless the data's range needs float64 (a value beyond float32's range or
its exact-integer range 2**24); the pass then restarts in float64 and records the reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from enn_core.bars import bar
from enn_core.config import DataConfig
from enn_core.data import splits
from enn_core.data.encode import Encoder, value_key
from enn_core.data.npyio import NpyWriter
from enn_core.data.sources import Chunk, Coded, Column, Source, SourceInfo
from enn_core.errors import DataError

NARROW_KINDS = {
    np.dtype(t) for t in ("float16", "float32", "int8", "int16", "uint8", "uint16", "bool")
}
F32_EXACT = float(2**24)


F32_MAX = float(np.finfo(np.float32).max)


class _Widen(Exception):
    def __init__(self, what: str, reason: str) -> None:
        self.what, self.reason = what, reason


def _needs64(a: np.ndarray) -> str | None:
    """Why `a` (finite) needs float64, or None."""
    if a.dtype in NARROW_KINDS or a.size == 0:
        return None
    big = max(abs(float(np.max(a))), abs(float(np.min(a))))
    if big >= F32_EXACT:
        return f"values up to {big:.4g} exceed float32's exact range (2**24)"
    return None


def _beyond_float32(a: np.ndarray) -> tuple[int, int] | None:
    """(row, column) of the first finite value beyond float32's range, which training
    computes in (a float64 input passes through staging but not through the model)."""
    if a.dtype.kind in "biu" or a.dtype == np.float32 or a.size == 0:
        return None
    if max(float(a.max()), -float(a.min())) <= F32_MAX:  # two reductions, no temporaries
        return None  # (a NaN fails the test: the exact search below skips it)
    flat = np.abs(a.reshape(a.shape[0], -1))
    big = np.isfinite(flat) & (flat > F32_MAX)
    if not big.any():
        return None
    r = int(np.flatnonzero(big.any(axis=1))[0])
    return r, int(np.flatnonzero(big[r])[0])


def _first_nonfinite(a: np.ndarray) -> tuple[int, int] | None:
    if a.dtype.kind in "biu" or a.size == 0:
        return None
    flat = a.reshape(a.shape[0], -1)
    if np.isfinite(np.add.reduce(flat, axis=None)):
        return None  # the sum of finite values can only overflow; check exactly below if not finite
    bad = ~np.isfinite(flat)
    if not bad.any():
        return None
    r = int(np.flatnonzero(bad.any(axis=1))[0])
    return r, int(np.flatnonzero(bad[r])[0])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _key_strings(col: Column) -> pa.Array:
    if isinstance(col, Coded):  # each level spelled once; a missing value reads "nan"
        spelled = pa.array([value_key(v) for v in col.levels] + ["nan"], pa.string())
        return spelled.take(pa.array(np.where(col.codes < 0, len(col.levels), col.codes)))
    if col.dtype.kind in "biu" or (col.dtype.kind == "f" and np.all(np.mod(col, 1) == 0)):
        return pa.array(col.astype(np.int64).astype(str))
    return pa.array([value_key(v) for v in col], pa.string())


def _no_hook(i: int) -> None:
    pass


@dataclass(frozen=True)
class ChunkHooks:
    """What a stage run adds to the write pass: its progress bar (label, shown when `progress`),
    a call before each chunk with the chunk's index (the stage's fault phase) and one after it
    with the rows written so far (the stage's progress line where no bar shows)."""

    label: str = "staging"
    progress: bool = False
    before_chunk: Callable[[int], None] = _no_hook
    rows_done: Callable[[int], None] = _no_hook


class ChunkWriter:
    codes_file = ".codes.npy"
    source_hash: str | None  # the input files' hash, set by staging once they are hashed

    def __init__(
        self,
        out: Path,
        cfg: DataConfig,
        info: SourceInfo,
        enc: Encoder,
        file: str,
        hooks: ChunkHooks | None = None,
    ) -> None:
        self.hooks = hooks or ChunkHooks()
        self.out, self.cfg, self.info, self.enc, self.file = out, cfg, info, enc, file
        self.has_labels = info.label_shape is not None
        # this pass's writers (None between passes)
        self._x: NpyWriter | None = None
        self._y: NpyWriter | None = None
        self._codes: NpyWriter | None = None
        self._keys: Any = None  # a pq.ParquetWriter (pyarrow has no types), at the first chunk
        self._stats_pool = ThreadPoolExecutor(max_workers=1)
        self._stats: Future[None] | None = None
        self.dtypes: dict[str, type[np.float32] | type[np.float64]] = {
            "features": np.float32,
            "labels": np.float32,
        }
        self.dtype_reason = "float32: the data fits float32's range"

    def run(self, source: Source) -> None:
        try:
            while True:
                try:
                    self._pass(source)
                    return
                except _Widen as w:
                    self._abort()
                    self.dtypes[w.what] = np.float64
                    self.dtype_reason = f"{w.what} float64: {w.reason}"
                except BaseException:
                    self._abort()
                    raise
        finally:
            self._stats_pool.shutdown()

    def _pass(self, source: Source) -> None:
        self.rows = self.dropped = 0
        self.stream = splits.streaming(self.cfg, self.info.n_rows)
        self.cont = [j for j, s in enumerate(self.enc.specs) if s["kind"] == "continuous"]
        self.fx = splits.Moments(len(self.cont))
        self.fy = splits.Moments(1) if self.has_labels else None
        self._x = x_w = NpyWriter(
            self.out / "features.npy", self.dtypes["features"], (len(self.info.feature_names),)
        )
        label_shape = cast(tuple[int, ...], self.info.label_shape)  # read only with labels
        self._y = y_w = (
            NpyWriter(self.out / "labels.npy", self.dtypes["labels"], label_shape)
            if self.has_labels
            else None
        )
        self._codes = codes_w = NpyWriter(self.out / self.codes_file, np.int8, ())
        hooks = self.hooks
        with bar(None, hooks.label, hooks.progress, unit="chunk") as pbar:
            for i, chunk in enumerate(source.chunks()):
                hooks.before_chunk(i)
                self._chunk(chunk, x_w, y_w, codes_w)
                pbar.update(1)
                hooks.rows_done(self.rows)
        if self.rows == 0:
            what = (
                "all rows had non-finite values and were dropped"
                if self.dropped
                else "no data rows"
            )
            raise DataError(f"{self.file}: empty table ({what}); give it data rows")
        self._hashes = {
            "features.npy": x_w.close(),
            "labels.npy": y_w.close() if y_w else None,
        }
        self.array_hashes = {"features": x_w.source_hash()}
        if y_w is not None:
            self.array_hashes["labels"] = y_w.source_hash()
        codes_w.close(sync=False)  # scratch: deleted before the directory is renamed
        self._stats_wait()
        self._keys.close()
        _fsync(self.out / "row_keys.parquet")  # like every file of the staged directory

    def _stats_wait(self) -> None:
        # statistics run in a helper thread (numpy releases the GIL) while this one writes
        if self._stats is not None:
            self._stats.result()
            self._stats = None

    def _abort(self) -> None:
        if self._stats is not None:
            self._stats.cancel() or self._stats.exception()
            self._stats = None
        for w in (self._x, self._y, self._codes):
            if w is not None:
                w.abort()
        if self._keys is not None:
            self._keys.close()
        self._x = self._y = self._codes = self._keys = None

    def _chunk(
        self, chunk: Chunk, x_w: NpyWriter, y_w: NpyWriter | None, codes_w: NpyWriter
    ) -> None:
        """Encode, check and append one chunk with this pass's writers (features, labels, codes)."""
        if chunk.rows == 0:
            return
        x = self.enc.encode(chunk, self.file)
        y = chunk.y
        self._in_range(chunk, x, y)
        keep = self._finite(chunk, x, y)
        if keep is not None:
            x, y = x[keep], (y[keep] if y is not None else None)
        for what, a in (("features", x), ("labels", y)):
            if a is not None and self.dtypes[what] == np.float32:
                reason = _needs64(a)
                if reason:
                    raise _Widen(what, reason)
        # the staged values (statistics describe exactly what later stages read)
        x = x.astype(self.dtypes["features"], copy=False)
        y = y.astype(self.dtypes["labels"], copy=False) if y is not None else None
        codes = splits.fold_codes(self.cfg, chunk.keys, chunk.rows, self.file)
        if self.stream is not None and not self.cfg.folds:
            codes = self.stream.take(chunk.rows)
        array = chunk.x is not None  # an array input: hash its data as it passes (the source hash)
        x_w.write(x, raw=chunk.x if array else None)
        if y_w is not None:
            y_w.write(cast(np.ndarray, y), raw=chunk.y if array else None)  # labels: y is set
        rows = np.arange(chunk.start, chunk.start + chunk.rows, dtype=np.int64)
        keys = chunk.keys if keep is None else {k: v[keep] for k, v in chunk.keys.items()}
        rows = rows if keep is None else rows[keep]
        codes_w.write(codes if keep is None else codes[keep])
        if self.stream is not None:  # splits known while staging: accumulate train rows now
            train = np.flatnonzero((codes if keep is None else codes[keep]) == splits.TRAIN)
            self._stats_wait()  # at most one chunk's statistics in flight (memory: two chunks)
            self._stats = self._stats_pool.submit(
                splits.accumulate, self.fx, self.fy, x, y, train, self.cont
            )
        table = pa.table(
            {**{k: _key_strings(v) for k, v in keys.items()}, "source_row": pa.array(rows)}
        )
        if self._keys is None:
            # dictionary-encode the key columns only: source_row is unique, where it only costs;
            # it mostly counts up by one, which delta encoding stores in almost nothing (and
            # writes about twice as fast as plain + snappy: millions of rows per GB staged)
            keys_dict = [k for k in table.column_names if k != "source_row"]
            self._keys = pq.ParquetWriter(
                self.out / "row_keys.parquet",
                table.schema,
                use_dictionary=keys_dict,
                column_encoding={"source_row": "DELTA_BINARY_PACKED"},
            )
        self._keys.write_table(table)
        self.rows += len(rows)

    def _in_range(self, chunk: Chunk, x: np.ndarray, y: np.ndarray | None) -> None:
        """Refuse a value beyond float32's range, naming its row and column."""
        for what, a in (("feature", x), ("label", y)):
            if a is None:
                continue
            hit = _beyond_float32(a)
            if hit is None:
                continue
            r, j = hit
            col = (
                f"feature {self.info.feature_names[j]!r}"
                if what == "feature"
                else self._label_name(j)
            )
            value = float(np.asarray(a).reshape(len(a), -1)[r, j])
            raise DataError(
                f"{self.file} {chunk.where(r)} {col}: {value:.4g} is beyond float32's range "
                f"(+-{F32_MAX:.3g}), which training computes in; rescale the column (e.g. "
                "thousands instead of units) or remove the row"
            )

    def _finite(self, chunk: Chunk, x: np.ndarray, y: np.ndarray | None) -> np.ndarray | None:
        """None when every value is finite; else the rows to keep (drop) or an error. A row
        that is malformed in its text (a short CSV row) is refused either way: dropping it
        would hide a broken file."""
        bx = _first_nonfinite(x)
        by = _first_nonfinite(y) if y is not None else None
        if bx is None and by is None:
            return None
        self._refuse_malformed(chunk, x, y)
        if self.cfg.nonfinite == "error":
            if bx is not None and (by is None or bx[0] <= by[0]):
                r, col = bx[0], f"feature {self.info.feature_names[bx[1]]!r}"
            elif by is not None:  # not both None (returned above)
                r, col = by[0], self._label_name(by[1])
            raise DataError(
                f"{self.file} {chunk.where(r)} {col}: NaN or infinite value; "
                "fix the input or set data.nonfinite=drop"
            )
        ok = np.isfinite(x.reshape(len(x), -1)).all(axis=1)
        if y is not None:
            ok &= np.isfinite(y.reshape(len(y), -1)).all(axis=1)
        self.dropped += int((~ok).sum())
        return ok

    def _refuse_malformed(self, chunk: Chunk, x: np.ndarray, y: np.ndarray | None) -> None:
        if chunk.malformed is None:
            return
        bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
        if y is not None:
            bad |= ~np.isfinite(y.reshape(len(y), -1)).all(axis=1)
        problems = chunk.malformed(np.flatnonzero(bad).tolist())
        if problems:
            r = min(problems)
            raise DataError(
                f"{self.file} {chunk.where(r)}: short row ({problems[r]}); give it every field "
                "of the header (data.nonfinite=drop does not drop malformed rows)"
            )

    def _label_name(self, j: int) -> str:
        if self.info.label_name is not None:
            return self.info.label_name(j)
        shape = cast(tuple[int, ...], self.info.label_shape)  # named only when there are labels
        return f"label {list(np.unravel_index(j, shape))}"

    def files(self) -> dict[str, dict[str, Any]]:
        """Manifest entries of the staged arrays (after `run`: the last pass's writers)."""
        x_w = cast(NpyWriter, self._x)
        out = {
            "features.npy": {
                "dtype": str(np.dtype(x_w.dtype)),
                "shape": list(x_w.shape),
                "hash": self._hashes["features.npy"],
            }
        }
        if self._y is not None:
            out["labels.npy"] = {
                "dtype": str(np.dtype(self._y.dtype)),
                "shape": list(self._y.shape),
                "hash": self._hashes["labels.npy"],
            }
        return out
