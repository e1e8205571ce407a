"""CSV and Parquet sources with declared columns, read in chunks of data.chunk_rows rows.

Both read through pyarrow: a CSV with its streaming reader (`pyarrow.csv.open_csv`), which
parses in C++ off the GIL, in a thread of its own that parses the next chunk while staging
checks, hashes and writes this one (`ReadAhead`); a Parquet file batch by batch within each
row group. Categorical, cyclic and fold-key columns travel as codes into their distinct
values (`Coded`): a Python string is made per distinct value, not per row. A CSV that
pyarrow does not read as pandas would (a short or long row, a value that is no number, text
in another encoding, ...) is read from that chunk on by pandas, whose reading names the row
and the fix, as it always has.
"""

from __future__ import annotations

import codecs
import csv
import functools
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import cast

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from enn_core.config import DataConfig
from enn_core.data.readahead import ReadAhead
from enn_core.data.sources import (
    Chunk,
    Coded,
    Column,
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
        # the columns read, and those of them read as codes (row keys and cycles)
        self.columns = self.feats + self.labels + [k for k in keys if k not in self.feats]
        self.coded = [c for c in self.columns if c in keys or c in cfg.cyclic]
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
        self, get: Callable[[str], Column], n: int, start: int, where: Callable[[int], str]
    ) -> Chunk:
        cols: dict[str, Column] = {}
        for c in self.feats:
            v = get(c)
            cols[c] = (
                v
                if (c in self.cats or c in self.cfg.cyclic)
                else numeric_column(cast(np.ndarray, v), c, where, self.path)
            )
        y = None
        if self.labels:
            flat = np.empty((n, len(self.labels)), np.float64)
            for j, c in enumerate(self.labels):  # labels are never coded
                flat[:, j] = numeric_column(cast(np.ndarray, get(c)), c, where, self.path)
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


# The spellings pandas.read_csv reads as a missing value (pandas._libs.parsers.STR_NA_VALUES);
# pyarrow's own list lacks "None" and "<NA>"
NA_VALUES = (
    *("", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN"),
    *("<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"),
)
# The spellings pyarrow is told are missing: those no number starts with. pyarrow looks every
# cell up among them, and a spelling that shares a number's first character (a sign, a
# digit) makes the lookup of most numbers go on past it: the six that do cost 13% of the
# parse (measured, 2026-11-29). A number column reads those six as pandas does all the same:
# "-nan" and "-NaN" pyarrow parses as NaN itself; "1.#IND", "1.#QNAN", "-1.#IND" and
# "-1.#QNAN" it refuses, and pandas reads on from that chunk. A coded column's levels are
# checked against the whole of NA_VALUES (`coded`).
ARROW_NA_VALUES = [v for v in NA_VALUES if not v.startswith(("-", "1"))]


def coded(col: pa.ChunkedArray, text: bool = False) -> Coded:
    """An Arrow column as codes into its distinct values (Arrow's dictionary encoding). `text`:
    CSV text, read as pandas reads it (`skipinitialspace`, then its missing-value spellings)."""
    if not pa.types.is_dictionary(col.type):
        col = pc.dictionary_encode(col)
    arr = col.chunk(0) if col.num_chunks == 1 else col.unify_dictionaries().combine_chunks()
    codes = pc.fill_null(arr.indices, -1).to_numpy()
    levels = arr.dictionary.to_numpy(zero_copy_only=False)
    if text:
        levels = np.array([v.lstrip() for v in levels], dtype=object)
        missing = np.array([v in NA_VALUES for v in levels] + [True])  # last: already missing
        if missing[:-1].any():
            codes = np.where(missing[codes], -1, codes)
    return Coded(codes, levels)


def as_numbers(col: Coded) -> Coded:
    """A text column of numbers as numbers, as pandas infers a column's type (chunk by chunk):
    the fold key, when not a feature, is read so (its keys: '07' is 7)."""
    present = col.present()
    num = pd.to_numeric(pd.Series(col.levels[present], dtype=object), errors="coerce")
    if not present.size or num.isna().any():
        return col
    levels = np.zeros(len(col.levels), num.dtype)
    levels[present] = num.to_numpy()
    return Coded(col.codes, levels)


class CsvSource(_TableSource):
    kind = "csv"

    def __init__(self, cfg: DataConfig, path: Path) -> None:
        header = csv_header(path, cfg.encoding)
        super().__init__(cfg, path, header, None)
        self.header = header
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
        # the next table is parsed (off the GIL) while this chunk is checked, hashed and written
        tables, start = ReadAhead(self._arrow_tables), 0
        try:
            while True:
                try:
                    table = next(tables, None)
                except (pa.ArrowException, UnicodeError):
                    # pyarrow refused a row or a value: pandas reads on from this chunk (the
                    # chunks so far were whole), and names the row and the fix if it fails too
                    yield from self._pandas_chunks(skip=start)
                    return
                if table is None:
                    break
                yield self._arrow_chunk(table, start)
                start += table.num_rows
        finally:
            tables.close()
            self.scanner.close()
        if start == 0:
            raise DataError(f"{self.path}: empty table (a header and no data rows); add data rows")

    def _arrow_tables(self) -> Generator[pa.Table, None, None]:
        """The data rows in tables of data.chunk_rows rows, from pyarrow's streaming reader:
        every column parsed (a row of another field count is refused), the used ones converted,
        numbers to float64, row keys and cycles dictionary-encoded."""
        utf8 = codecs.lookup(self.cfg.encoding).name == "utf-8"  # checked by csv_header
        text = pa.dictionary(pa.int32(), pa.string())
        reader = pacsv.open_csv(
            self.path,
            read_options=pacsv.ReadOptions(
                column_names=self.header,
                skip_rows=1,
                block_size=self._block_size(),
                encoding="utf8" if utf8 else self.cfg.encoding,
            ),
            # a row of another field count than the header raises (pyarrow's default)
            parse_options=pacsv.ParseOptions(newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(
                column_types={c: text if c in self.coded else pa.float64() for c in self.columns},
                include_columns=self.columns,
                null_values=ARROW_NA_VALUES,
                strings_can_be_null=True,
            ),
            # glibc's malloc: its reader threads retain ~15 MB less than pyarrow's default
            # pool (mimalloc), for ~8% more parsing time (measured, 2026-11-29)
            memory_pool=pa.system_memory_pool(),
        )
        try:
            step, pending, have = self.cfg.chunk_rows, list[pa.RecordBatch](), 0
            for batch in reader:
                pending.append(batch)
                have += batch.num_rows
                while have >= step:
                    table = pa.Table.from_batches(pending, reader.schema)
                    yield table.slice(0, step)
                    pending, have = table.slice(step).to_batches(), have - step
            if have:
                yield pa.Table.from_batches(pending, reader.schema)
        finally:
            reader.close()

    def _block_size(self) -> int:
        """Bytes of text pyarrow parses at a time: an eighth of a chunk's rows (the row size
        estimated from the file's head), within 64 KiB..1 MiB. Its reader reads up to 32
        blocks ahead (measured: peak memory ~ 8 MB + 30 blocks), so a block caps what the
        reader holds at about four chunks of text, and at 32 MiB. A row longer than a block
        is refused, and pandas reads the file."""
        with open(self.path, "rb") as f:
            head = f.read(1 << 20)
        row = len(head) / max(head.count(b"\n"), 1)
        return int(min(max(row * self.cfg.chunk_rows / 8, 1 << 16), 1 << 20))

    def _arrow_chunk(self, table: pa.Table, start: int) -> Chunk:
        def get(c: str) -> Column:
            col = table.column(c)
            if c not in self.coded:
                return col.to_numpy()  # float64, a missing value NaN
            codes = coded(col, text=True)
            return codes if c in self.feats else as_numbers(codes)

        def where(i: int, s: int = start) -> str:
            return f"line {s + i + 2}"

        return self._chunk(get, table.num_rows, start, where)

    def _pandas_chunks(self, skip: int) -> Iterator[Chunk]:
        """The chunks from data row `skip` on (a multiple of data.chunk_rows), read by pandas."""
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
                if start < skip:  # read whole by pyarrow already
                    start += n
                    continue

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
        if start == 0:
            raise DataError(f"{self.path}: empty table (a header and no data rows); add data rows")


PARQUET_BUFFER = 1 << 18  # bytes a column's reader buffers


class ParquetSource(_TableSource):
    kind = "parquet"

    def __init__(self, cfg: DataConfig, path: Path) -> None:
        try:
            # a column chunk is read through a buffer, page by page: unbuffered (or with
            # pre_buffer), pyarrow holds every column chunk of the row group, which grows
            # with the rows a writer put in a group (pyarrow: up to 1 Mi rows)
            self.pf = pq.ParquetFile(path, pre_buffer=False, buffer_size=PARQUET_BUFFER)
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(
                f"{path}: not a readable Parquet file ({' '.join(str(e).split())}); "
                "re-write it with pyarrow"
            ) from e
        super().__init__(cfg, path, list(self.pf.schema_arrow.names), self.pf.metadata.num_rows)
        if self.pf.metadata.num_rows == 0:
            raise DataError(f"{path}: empty table (no rows); add data rows")

    def chunks(self) -> Iterator[Chunk]:
        """Each row group in chunks of at most data.chunk_rows rows (a row group no larger is
        one chunk)."""
        start = 0
        for g in range(self.pf.num_row_groups):
            for batch in self._row_group(g):
                n = batch.num_rows

                def get(c: str, b: pa.RecordBatch = batch) -> Column:
                    col = pa.chunked_array([b.column(c)])
                    return coded(col) if c in self.coded else col.to_numpy()

                def where(i: int, s: int = start) -> str:
                    return f"row {s + i}"

                yield self._chunk(get, n, start, where)
                start += n
                del batch

    def _row_group(self, g: int) -> Iterator[pa.RecordBatch]:
        try:
            yield from self.pf.iter_batches(
                batch_size=self.cfg.chunk_rows, row_groups=[g], columns=self.columns
            )
        except (pa.ArrowException, OSError) as e:
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise DataError(
                f"{self.path} row group {g}: unreadable ({first}); re-write the file with "
                "pyarrow or pandas"
            ) from None
