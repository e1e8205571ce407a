"""Prediction results in real units, beside `predictions.npy`.

- `predictions.parquet`: one row per predicted row, keyed by the input's row keys (plus `row`,
  the row's index in the staged dataset), then one float column per output cell named by the
  label axis values joined with '|' (e.g. `성남IC-판교JC|07`). Written in row groups.
- `predictions.xlsx` (workbook sources only): the input workbook's layout, sheet by sheet and
  row by row, with the time columns replaced by predictions. A sheet is written when at least
  one of its rows was predicted; a row whose group was not predicted keeps empty time cells.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openpyxl
import pyarrow as pa
import pyarrow.parquet as pq

from enn_core.config.data import WorkbookLayout
from enn_core.data.workbook import canonical_section
from enn_core.errors import DataError


def cell_names(
    label_shape: Sequence[int], axes: Sequence[str], axis_values: Mapping[str, Sequence[object]]
) -> list[str]:
    """Column names of the flattened output cells, in C order."""
    per_axis = []
    for i, n in enumerate(label_shape):
        name = axes[i] if i < len(axes) else None
        values = list(axis_values.get(name) or []) if name else []
        per_axis.append(
            [str(v) for v in values]
            if len(values) == n
            else [f"{name or 'y'}{j}" for j in range(n)]
        )
    return ["|".join(c) for c in itertools.product(*per_axis)] if per_axis else ["y"]


def write_parquet(
    path: str | Path,
    preds: np.ndarray,
    keys: pa.Table | None,
    rows: np.ndarray,
    names: list[str],
    chunk_rows: int = 16384,
) -> None:
    """`preds` [N, *label_shape] -> a keyed wide table (keys = the predicted rows' key columns)."""
    n = preds.shape[0]
    # (field, column) of each key column, in the table's order; none without keys
    key_cols = (
        [(keys.schema.field(c), keys.column(c)) for c in keys.column_names]
        if keys is not None
        else []
    )
    schema = pa.schema(
        [pa.field("row", pa.int64())]
        + [f for f, _ in key_cols]
        + [pa.field(c, pa.from_numpy_dtype(preds.dtype)) for c in names]
    )
    with pq.ParquetWriter(str(path), schema) as w:
        for r0 in range(0, max(n, 1), chunk_rows):
            r1 = min(r0 + chunk_rows, n)
            flat = np.asarray(preds[r0:r1]).reshape(r1 - r0, -1)
            cols = [pa.array(np.asarray(rows[r0:r1], dtype=np.int64))]
            cols += [col.slice(r0, r1 - r0) for _, col in key_cols]
            cols += [pa.array(flat[:, j]) for j in range(flat.shape[1])]
            w.write_table(pa.Table.from_arrays(cols, schema=schema))


def write_workbook(
    path: str | Path,
    source: str | Path,
    layout: WorkbookLayout,
    preds: np.ndarray,
    keys: pa.Table,
    axis_values: Mapping[str, Sequence[object]],
    axes: Sequence[str],
) -> dict[str, int]:
    """The source workbook with its time columns replaced by `preds`; returns what was written."""
    if preds.ndim != 3:
        raise DataError(
            f"{source}: an .xlsx output needs [N, section, time] predictions, "
            f"got {list(preds.shape)}"
        )
    sections = {str(s): i for i, s in enumerate(axis_values.get(axes[0]) or [])}
    times = {str(t): i for i, t in enumerate(axis_values.get(axes[1]) or [])}
    group_keys = list(layout.group_keys)
    lookup = {
        tuple(str(v) for v in vals): i
        for i, vals in enumerate(
            zip(*(keys.column(k).to_pylist() for k in group_keys), strict=True)
        )
    }
    sheet_re, time_re = re.compile(layout.sheet_pattern), re.compile(layout.time_pattern)
    fill = _Fill(layout, group_keys, lookup, sections, times, time_re, preds)
    src = openpyxl.load_workbook(source, read_only=True, data_only=True)
    out = openpyxl.Workbook(write_only=True)
    written = {"sheets": 0, "rows": 0}
    try:
        for ws in src.worksheets:
            m = sheet_re.match(ws.title)
            if not m:
                continue
            it = ws.iter_rows(values_only=True)
            header = list(next(it, []))
            rows = _sheet_rows(it, header, m.groupdict(), fill, where=f"{source}[{ws.title}]")
            if rows[1]:
                sheet = out.create_sheet(ws.title)
                sheet.append(header)
                for r in rows[0]:
                    sheet.append(r)
                written["sheets"] += 1
                written["rows"] += rows[1]
        out.save(str(path))
    finally:
        src.close()
    return written


@dataclass(frozen=True)
class _Fill:
    """What every sheet's rows are filled from: the layout, the predicted groups (`lookup`: group
    key values -> row of `preds`), the section and time positions, and the predictions."""

    layout: WorkbookLayout
    group_keys: list[str]
    lookup: dict[tuple[str, ...], int]
    sections: dict[str, int]
    times: dict[str, int]
    time_re: re.Pattern[str]
    preds: np.ndarray


def _sheet_rows(
    it: Iterator[tuple[Any, ...]],
    header: list[Any],
    sheet_keys: Mapping[str, Any],
    fill: _Fill,
    where: str,
) -> tuple[list[list[Any]], int]:
    """(rows of one sheet with predictions filled in, how many rows were predicted)."""
    layout = fill.layout
    try:
        sec_col, dir_col = (
            header.index(layout.section_column),
            header.index(layout.direction_column),
        )
    except ValueError as e:
        raise DataError(
            f"{where}: header lacks {layout.section_column!r} or {layout.direction_column!r}; "
            "check data.workbook"
        ) from e
    time_cols = [
        (j, fill.times.get(m.group("hour")))
        for j, h in enumerate(header)
        if (m := fill.time_re.match(str(h)))
    ]
    out, hit = [], 0
    for raw in it:
        row = list(raw)
        keys = dict(sheet_keys)
        for k in fill.group_keys:
            keys.setdefault(k, row[dir_col])  # the one group key not named by the sheet
        pos = fill.lookup.get(tuple(str(keys[k]) for k in fill.group_keys))
        sec = fill.sections.get(canonical_section(row[sec_col], layout, where))
        for j, t in time_cols:
            row[j] = (
                float(fill.preds[pos, sec, t])
                if pos is not None and sec is not None and t is not None
                else None
            )
        hit += pos is not None and sec is not None
        out.append(row)
    return out, hit
