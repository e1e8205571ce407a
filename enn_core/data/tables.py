"""CSV (read in chunks) and Parquet (read by row group) sources with declared columns."""

from __future__ import annotations

import csv
import functools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import cast

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from enn_core.config import DataConfig
from enn_core.data.sources import (
    Chunk,
    SourceInfo,
    csv_header,
    encoding_error,
    header_columns,
    reshape_labels,
)
from enn_core.errors import DataError


def numeric_column(
    values: np.ndarray, name: str, where: Callable[[int], str], file: Path
) -> np.ndarray:
    """float64 view of a column, or an error naming the first non-numeric cell."""
    if values.dtype.kind in "biuf":
        return values.astype(np.float64, copy=False)
    num = pd.to_numeric(pd.Series(values), errors="coerce").to_numpy(np.float64)
    bad = np.flatnonzero(np.isnan(num) & pd.notna(pd.Series(values)).to_numpy())
    if bad.size:
        i = int(bad[0])
        raise DataError(
            f"{file} {where(i)} column {name!r}: non-numeric value {values[i]!r}; fix the cell "
            "or declare the column in data.categorical"
        )
    return num


class _TableSource:
    kind = "table"

    def __init__(self, cfg: DataConfig, path: Path, names: list[str], n_rows: int | None) -> None:
        self.cfg, self.path = cfg, path
        self.feats, self.labels = header_columns(path, names, cfg, cfg.features_only)
        self.cats = [c for c in self.feats if c in cfg.categorical]
        keys = [c for c in self.feats if c in cfg.categorical or c == cfg.fold_key]
        # the fold key, when not a feature: read to split the rows, never a model input (new
        # inputs to predict need not carry it)
        self.fold = (
            cfg.fold_key
            if cfg.fold_key and cfg.fold_key not in self.feats and cfg.fold_key in names
            else None
        )
        if self.fold is not None and not cfg.features_only:
            keys.append(self.fold)
        label_shape = None
        if self.labels:
            label_shape = reshape_labels(
                np.empty((0, len(self.labels))), cfg, f"{path} label columns"
            )
        self.info = SourceInfo(
            kind=self.kind,
            path=path,
            feature_names=self.feats,
            label_shape=label_shape,
            row_keys=keys,
            n_rows=n_rows,
            label_name=lambda j: f"column {self.labels[j]!r}",
            inputs=[path],
            # one label axis: its values are the label columns' names (the outputs' names)
            label_axis_values=(
                {"label": list(self.labels)}
                if label_shape is not None and len(label_shape) == 1
                else None
            ),
        )

    def _chunk(
        self, get: Callable[[str], np.ndarray], n: int, start: int, where: Callable[[int], str]
    ) -> Chunk:
        cols: dict[str, np.ndarray] = {}
        for c in self.feats:
            v = get(c)
            cols[c] = (
                v
                if (c in self.cats or c in self.cfg.cyclic)
                else numeric_column(v, c, where, self.path)
            )
        y = None
        if self.labels:
            flat = np.empty((n, len(self.labels)), np.float64)
            for j, c in enumerate(self.labels):
                flat[:, j] = numeric_column(get(c), c, where, self.path)
            # label columns give the label shape (__init__)
            y = flat.reshape((n, *cast(tuple[int, ...], self.info.label_shape)))
        keys = {k: cols[k] if k in cols else get(k) for k in self.info.row_keys}
        return Chunk(start=start, cols=cols, y=y, keys=keys, where=where)

    def close(self) -> None:
        pass


class RecordScanner:
    """Field counts of a CSV file's data records, read forward only (the quoting rules of
    the csv module): a short row and an empty cell both reach pandas as a missing value, so
    the rows a chunk cannot use are looked up in the text itself. Asked only about rows with
    missing values, in increasing order, it reads the file at most once."""

    def __init__(self, path: Path, encoding: str) -> None:
        self.path, self.encoding = path, encoding
        self._records: Iterator[list[str]] | None = None
        self._index = -1  # data record index last read (the header is not a data record)
        self._fields = 0

    def fields(self, index: int) -> int:
        if self._records is None or index < self._index:
            self._file = open(self.path, newline="", encoding=self.encoding)  # noqa: SIM115
            self._records = csv.reader(self._file, skipinitialspace=True)
            next(self._records, None)
            self._index = -1
        while self._index < index:
            row = next(self._records, None)
            if row is None:
                return 0
            if not row:  # a blank line: pandas skips it too
                continue
            self._index += 1
            self._fields = len(row)
        return self._fields

    def close(self) -> None:
        if self._records is not None:
            self._file.close()
            self._records = None


class CsvSource(_TableSource):
    kind = "csv"

    def __init__(self, cfg: DataConfig, path: Path) -> None:
        header = csv_header(path, cfg.encoding)
        super().__init__(cfg, path, header, None)
        self.n_fields = len(header)
        self.scanner = RecordScanner(path, cfg.encoding)

    def malformed(self, start: int, rows: Sequence[int]) -> dict[int, str]:
        """Of chunk rows `rows` (the chunk starts at data record `start`), the short ones."""
        out = {}
        for i in sorted(rows):
            n = self.scanner.fields(start + i)
            if n < self.n_fields:
                out[i] = f"it has {n} fields, the header {self.n_fields}"
        return out

    def chunks(self) -> Iterator[Chunk]:
        str_cols = {c: str for c in self.feats if c in self.cats or c in self.cfg.cyclic}
        reader = pd.read_csv(
            self.path,
            chunksize=self.cfg.chunk_rows,
            # every column is parsed: `usecols` would hide rows with too many fields
            dtype=str_cols,
            skipinitialspace=True,
            encoding=self.cfg.encoding,
        )
        start = 0
        try:
            for df in reader:
                n = len(df)

                def get(c: str, d: pd.DataFrame = df) -> np.ndarray:
                    return d[c].to_numpy()

                def where(i: int, s: int = start) -> str:
                    return f"line {s + i + 2}"

                chunk = self._chunk(get, n, start, where)
                chunk.malformed = functools.partial(self.malformed, start)
                yield chunk
                start += n
        except pd.errors.ParserError as e:
            msg = str(e).strip().splitlines()[-1].split("C error: ")[-1]
            raise DataError(
                f"{self.path}: ragged row ({msg}); give every row the header's fields"
            ) from e
        except UnicodeDecodeError as e:
            raise encoding_error(self.path, self.cfg.encoding, e) from None
        finally:
            reader.close()
            self.scanner.close()
        if start == 0:
            raise DataError(f"{self.path}: empty table (a header and no data rows); add data rows")


class ParquetSource(_TableSource):
    kind = "parquet"

    def __init__(self, cfg: DataConfig, path: Path) -> None:
        try:
            self.pf = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(
                f"{path}: not a readable Parquet file ({' '.join(str(e).split())}); "
                "re-write it with pyarrow"
            ) from e
        super().__init__(cfg, path, list(self.pf.schema_arrow.names), self.pf.metadata.num_rows)
        if self.pf.metadata.num_rows == 0:
            raise DataError(f"{path}: empty table (no rows); add data rows")

    def chunks(self) -> Iterator[Chunk]:
        start = 0
        for g in range(self.pf.num_row_groups):
            try:
                extra = [self.fold] if self.fold and self.fold in self.info.row_keys else []
                table = self.pf.read_row_group(g, columns=self.feats + self.labels + extra)
            except (pa.ArrowException, OSError) as e:
                first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                raise DataError(
                    f"{self.path} row group {g}: unreadable ({first}); re-write the file with "
                    "pyarrow or pandas"
                ) from None
            n = table.num_rows

            def get(c: str, t: pa.Table = table) -> np.ndarray:
                return t.column(c).to_numpy(zero_copy_only=False)

            def where(i: int, s: int = start) -> str:
                return f"row {s + i}"

            yield self._chunk(get, n, start, where)
            start += n
            del table
