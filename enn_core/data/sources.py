"""Input readers for stage-data: each yields the input in chunks of rows.

A source knows its feature names, the per-row label shape (None in features-only mode), its
row-key columns, and yields `Chunk`s: features as one numeric matrix (array sources) or as
named columns (tables, workbook), labels, row keys, and a function naming a row's location
in the input for error messages. Readers never hold more than a chunk of the input.
"""

from __future__ import annotations

import csv
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol, TypeAlias, cast

import numpy as np

from enn_core.config import DataConfig
from enn_core.data.npyio import npz_member, read_header, read_rows
from enn_core.errors import DataError


@dataclass(frozen=True)
class Coded:
    """A column as codes into its distinct values, as a dictionary-encoded Arrow column holds
    it: row i is `levels[codes[i]]`, missing where `codes[i] < 0`. Tables pass categorical
    and cyclic columns so, and each distinct value is looked at once a chunk, not once a row.
    `levels` may hold values no row of the chunk uses (a slice of a larger batch)."""

    codes: np.ndarray  # [rows] integers
    levels: np.ndarray  # [k] the values: str objects or numbers

    @staticmethod
    def of(values: np.ndarray) -> Coded:
        """A plain column, coded by its distinct values (np.unique: sorted levels)."""
        levels, codes = np.unique(values, return_inverse=True)
        return Coded(codes.reshape(-1), levels)

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, rows: np.ndarray) -> Coded:
        return Coded(self.codes[rows], self.levels)

    def present(self) -> np.ndarray:
        """Indices of the levels some row holds, ascending."""
        valid = self.codes[self.codes >= 0]
        return np.flatnonzero(np.bincount(valid, minlength=len(self.levels)))

    def first_rows(self) -> np.ndarray:
        """The first row holding each level (len(self) for a level no row holds)."""
        first = np.full(len(self.levels), len(self.codes), np.int64)
        valid = np.flatnonzero(self.codes >= 0)
        levels, at = np.unique(self.codes[valid], return_index=True)
        first[levels] = valid[at]
        return first

    def first_row_in(self, levels: np.ndarray) -> int:
        """The first row whose level is one of `levels` (indices into self.levels)."""
        hit = np.zeros(len(self.levels) + 1, bool)  # the last slot: missing rows (code -1)
        hit[levels] = True
        return int(np.flatnonzero(hit[self.codes])[0])

    def value(self, row: int) -> object:
        code = int(self.codes[row])
        return self.levels[code] if code >= 0 else None


Column: TypeAlias = np.ndarray | Coded  # a table column as a chunk carries it


@dataclass
class Chunk:
    start: int  # index of the chunk's first row in the input
    x: np.ndarray | None = None  # [c, F] numeric features (array sources)
    cols: Mapping[str, Column] | None = None  # features by name (tables, workbook)
    y: np.ndarray | None = None  # [c, *label_shape]
    keys: Mapping[str, Column] = field(default_factory=dict)  # row-key columns
    where: Callable[[int], str] = lambda i: f"row {i}"  # names chunk row i in the input
    # text inputs: what is malformed about chunk rows (e.g. a short CSV row), by row index
    malformed: Callable[[Sequence[int]], dict[int, str]] | None = None

    @property
    def rows(self) -> int:
        if self.x is not None:
            return self.x.shape[0]
        if self.cols:
            return len(next(iter(self.cols.values())))
        return 0 if self.y is None else self.y.shape[0]


@dataclass
class SourceInfo:
    kind: str
    path: Path | None
    feature_names: list[str]
    label_shape: tuple[int, ...] | None  # None: no labels (features-only)
    label_axis_values: dict[str, list[str]] | None = None
    row_keys: list[str] = field(default_factory=list)
    n_rows: int | None = None
    label_name: Callable[[int], str] | None = None  # names flat label index j in messages
    inputs: list[Path] = field(
        default_factory=list
    )  # input files hashed whole (arrays: data hashed)


class Source(Protocol):
    """What stage-data reads from: every reader below (and the synthetic generator)."""

    info: SourceInfo

    def chunks(self) -> Iterator[Chunk]: ...

    def close(self) -> None: ...


# An array input: (a memmap, or an .npz member's stream, or None when empty; shape; dtype)
_ArraySpec = tuple[np.memmap | IO[bytes] | None, tuple[int, ...], np.dtype]


def reshape_labels(y: np.ndarray, cfg: DataConfig, where: str) -> tuple[int, ...]:
    """The per-row label shape after the declared reshape (data.label_shape)."""
    tail = tuple(y.shape[1:]) or (1,)
    if not cfg.label_shape:
        return tail
    want = tuple(cfg.label_shape)
    if int(np.prod(want)) != int(np.prod(tail)):
        raise DataError(
            f"{where}: labels have {int(np.prod(tail))} values per row {list(tail)} "
            f"but data.label_shape={list(want)} needs {int(np.prod(want))}; "
            "fix data.label_shape or the label columns"
        )
    return want


class ArraySource:
    """Features and labels from .npy files (memmapped) or .npz members (streamed)."""

    def __init__(self, cfg: DataConfig, x_path: Path, y_path: Path | None, npz: bool) -> None:
        self.cfg = cfg
        self._closers: list[zipfile.ZipFile] = []
        self._x: _ArraySpec
        self._y: _ArraySpec | None
        if npz:
            zf, fx, xs, xd = npz_member(x_path, cfg.npz_features_key)
            self._closers.append(zf)
            self._x = (fx, xs, xd)
            self._y = None
            if y_path is not None:
                zf2, fy, ys, yd = npz_member(x_path, cfg.npz_labels_key)
                self._closers.append(zf2)
                self._y = (fy, ys, yd)
            xname, yname = f"{x_path}[{cfg.npz_features_key}]", f"{x_path}[{cfg.npz_labels_key}]"
        else:
            self._x = self._open_npy(x_path)
            self._y = self._open_npy(y_path) if y_path is not None else None
            xname, yname = str(x_path), str(y_path)
        xshape = self._x[1]
        if len(xshape) not in (1, 2):
            raise DataError(f"{xname}: features must be [rows, features], got shape {list(xshape)}")
        n, nf = xshape[0], (xshape[1] if len(xshape) == 2 else 1)
        names = list(cfg.feature_columns) or [f"f{i}" for i in range(nf)]
        if len(names) != nf:
            raise DataError(
                f"{xname}: {nf} feature columns but data.feature_columns names {len(names)}; "
                "fix the list"
            )
        label_shape = None
        if self._y is not None:
            ys = self._y[1]
            if len(ys) == 0 or ys[0] != n:
                raise DataError(
                    f"{yname}: {ys[0] if ys else 0} label rows but {xname} has {n} feature rows; "
                    "stage features and labels of the same rows"
                )
            label_shape = reshape_labels(np.empty((0, *ys[1:])), cfg, yname)
        self.xname, self.yname = xname, yname
        self.info = SourceInfo(
            kind="npz" if npz else "npy",
            path=x_path,
            feature_names=names,
            label_shape=label_shape,
            row_keys=[c for c in cfg.categorical if c in names],
            n_rows=n,
        )

    def _open_npy(self, path: Path) -> _ArraySpec:
        with open(path, "rb") as f:
            shape, dtype, fortran = read_header(f, str(path))
            offset = f.tell()
        expected = offset + int(np.prod(shape)) * dtype.itemsize
        if path.stat().st_size < expected:
            raise DataError(
                f"{path}: truncated ({path.stat().st_size} bytes, its header promises {shape} "
                f"{dtype}: {expected} bytes); re-write or re-copy the file"
            )
        if fortran and len(shape) > 1:
            raise DataError(
                f"{path}: Fortran-ordered array; save it C-ordered (np.ascontiguousarray)"
            )
        mm = (
            np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
            if np.prod(shape)
            else None
        )
        return (mm, shape, dtype)

    def _rows(self, spec: _ArraySpec, start: int, n: int) -> np.ndarray:
        src, shape, dtype = spec
        if isinstance(src, np.memmap) or src is None:
            arr = src[start : start + n] if src is not None else np.empty((0, *shape[1:]), dtype)
        else:
            arr = read_rows(src, dtype, tuple(shape[1:]), n)
        return arr

    def chunks(self) -> Iterator[Chunk]:
        n, step = self.info.n_rows or 0, self.cfg.chunk_rows
        for start in range(0, n, step):
            c = min(step, n - start)
            x = self._rows(self._x, start, c)
            x = x.reshape(c, -1)
            y = None
            if self._y is not None:  # labels: their shape was checked in __init__
                label_shape = cast(tuple[int, ...], self.info.label_shape)
                y = self._rows(self._y, start, c).reshape((c, *label_shape))
            keys = {k: x[:, self.info.feature_names.index(k)] for k in self.info.row_keys}

            def where(i: int, s: int = start) -> str:
                return f"row {s + i}"

            yield Chunk(start=start, x=x, y=y, keys=keys, where=where)

    def close(self) -> None:
        for c in self._closers:
            c.close()


def header_columns(
    path: Path, names: list[str], cfg: DataConfig, features_only: bool
) -> tuple[list[str], list[str]]:
    """Feature and label columns of a table, checked for duplicates and absent names."""
    where = str(path)
    dup = sorted({c for c in names if names.count(c) > 1})
    if dup:
        raise DataError(f"{where}: duplicate column {dup[0]!r}; rename one of them")
    labels = [] if features_only else list(cfg.label_columns)
    if not features_only and not labels:
        raise DataError(
            f"{where}: data.label_columns is empty; name the label columns of the table"
        )
    # the fold key splits the rows; it is a model input only when data.feature_columns says so
    apart = {*cfg.label_columns, cfg.fold_key}
    feats = list(cfg.feature_columns) or [c for c in names if c not in apart]
    for c in feats + labels:
        if c not in names:
            raise DataError(
                f"{where}: missing column {c!r} (columns: {names}); fix the file or data.*_columns"
            )
    if not feats:
        raise DataError(f"{where}: no feature columns; set data.feature_columns")
    return feats, labels


def encoding_error(path: Path, encoding: str, e: UnicodeDecodeError) -> DataError:
    """The first line of `path` that is not `encoding`, named with the byte and the fix."""
    line = 0
    with open(path, "rb") as f:
        for line, raw in enumerate(f, start=1):  # noqa: B007 - the line is the answer
            try:
                raw.decode(encoding)
            except UnicodeDecodeError as bad:
                byte = raw[bad.start : bad.start + 1].hex()
                return DataError(
                    f"{path} line {line}: byte 0x{byte} is not valid {encoding}; save the file "
                    f"as UTF-8, or set data.encoding to its encoding (e.g. latin-1 or cp1252)"
                )
    return DataError(f"{path}: not valid {encoding} ({e.reason}); set data.encoding")


def csv_header(path: Path, encoding: str = "utf-8") -> list[str]:
    try:
        with open(path, newline="", encoding=encoding) as f:
            row = next(csv.reader(f), None)
    except UnicodeDecodeError as e:
        raise encoding_error(path, encoding, e) from None
    except LookupError:
        raise DataError(
            f"{path}: data.encoding={encoding!r} is not a known encoding; use e.g. utf-8, "
            "latin-1 or cp1252"
        ) from None
    if not row:
        raise DataError(f"{path}: empty table (no header row); write a header and data rows")
    return [c.strip() for c in row]
