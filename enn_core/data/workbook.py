"""A spatio-temporal workbook, read by the layout declared in `data.workbook`.

Sheet names give key values (a regex with named groups, e.g. month and day type); inside a
sheet, rows are keyed by a section column ("A-B") and a direction column, and the time-axis
columns (a regex with a group 'hour') hold the values. One sample per (sheet keys, direction):
its label is the [sections, hours] grid. Sections are canonicalised by sorting their two ends
so both directions share one section order (the order of first appearance in the first sheet).

openpyxl parses through defusedxml (installed), so untrusted workbooks cannot XML-bomb it.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from xml.etree.ElementTree import ParseError

import numpy as np
import openpyxl
import openpyxl.xml
from defusedxml import DefusedXmlException

from enn_core.config import DataConfig, WorkbookLayout
from enn_core.data.sources import Chunk, SourceInfo
from enn_core.errors import DataError


def canonical_section(raw: object, layout: WorkbookLayout, where: str) -> str:
    text = str(raw).strip() if raw is not None else ""
    parts = [p.strip() for p in text.split(layout.section_separator)]
    if len(parts) != 2 or not all(parts):
        raise DataError(
            f"{where}: section {raw!r} is not 'A{layout.section_separator}B'; fix the cell or "
            "data.workbook.section_separator"
        )
    if layout.canonical_sections:
        parts = sorted(parts)
    return layout.section_separator.join(parts)


# A sheet row as openpyxl reads it: one cell value (number, text, date or None) per column
Row = tuple[Any, ...]


def _safe_rows(rows: Iterator[Row], where: str) -> Iterator[Row]:
    """Rows of a read-only sheet, whose XML is parsed lazily: unsafe or broken XML -> DataError."""
    try:
        yield from rows
    except DefusedXmlException as e:
        raise DataError(
            f"{where}: refused unsafe XML ({type(e).__name__}); do not stage this file, "
            "re-save it from a trusted tool"
        ) from e
    except ParseError as e:
        raise DataError(f"{where}: malformed sheet XML ({e}); re-save the workbook") from e


def _hour_values(row: Row, header: Row, times: list[tuple[str, int]], at: str) -> list[float]:
    """A data row's values in the hour columns (an empty cell is NaN); `at` names the row."""
    vals = []
    for _, j in times:
        v = row[j] if j < len(row) else None
        if v is not None and not isinstance(v, (int, float)):
            raise DataError(f"{at} column {header[j]!r}: non-numeric value {v!r}; fix the cell")
        vals.append(np.nan if v is None else float(v))
    return vals


class WorkbookSource:
    kind = "workbook"

    def __init__(self, cfg: DataConfig, path: Path) -> None:
        if not openpyxl.xml.DEFUSEDXML:
            raise DataError(
                "defusedxml is not importable; install it so untrusted workbooks parse safely"
            )
        self.cfg, self.lay, self.path = cfg, cfg.workbook, path
        self.sheet_re = re.compile(self.lay.sheet_pattern)
        self.time_re = re.compile(self.lay.time_pattern)
        self.labels = not cfg.features_only
        known = set(self.sheet_re.groupindex) | {self.lay.direction_key}
        missing = [k for k in self.lay.group_keys if k not in known]
        if missing:
            raise DataError(
                f"{path}: group key {missing[0]!r} is neither a named group of "
                "data.workbook.sheet_pattern nor data.workbook.direction_key; "
                "fix data.workbook.group_keys"
            )
        try:
            self.wb = openpyxl.load_workbook(path, read_only=True, data_only=True)
        except (zipfile.BadZipFile, KeyError, OSError, ValueError, ParseError) as e:
            cause: BaseException | None = e
            while cause is not None and not isinstance(cause, DefusedXmlException):
                cause = cause.__cause__ or cause.__context__
            if cause is not None:
                raise DataError(
                    f"{path}: refused unsafe XML ({type(cause).__name__}); do not stage this file, "
                    "re-save it from a trusted tool"
                ) from e
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(
                f"{path}: not a readable .xlsx workbook ({first}); save it as .xlsx"
            ) from e
        self.sheets = self._parse_names()
        self.sections: list[str] = []
        self.hours: list[str] = []
        self._first = self._read_sheet(self.sheets[0][0], first=True)
        label_shape = (len(self.sections), len(self.hours)) if self.labels else None
        self.info = SourceInfo(
            kind="workbook",
            path=path,
            feature_names=list(self.lay.group_keys),
            label_shape=label_shape,
            label_axis_values={"section": self.sections, "hour": self.hours}
            if self.labels
            else None,
            row_keys=list(self.lay.group_keys),
            label_name=self.label_name,
            inputs=[path],
        )

    def _parse_names(self) -> list[tuple[str, dict[str, str]]]:
        out: list[tuple[str, dict[str, str]]] = []
        seen: dict[tuple[tuple[str, str], ...], str] = {}
        for name in self.wb.sheetnames:
            m = self.sheet_re.match(name)
            if not m:
                raise DataError(
                    f"{self.path} sheet {name!r}: name does not match data.workbook.sheet_pattern "
                    f"{self.lay.sheet_pattern!r}; rename the sheet or fix the pattern"
                )
            keys = m.groupdict()
            ident = tuple((g, keys[g]) for g in self.lay.group_keys if g in keys)
            if ident in seen:
                raise DataError(
                    f"{self.path} sheets {seen[ident]!r} and {name!r}: "
                    f"duplicate group keys {keys}; "
                    "remove one sheet or fix data.workbook.sheet_pattern"
                )
            seen[ident] = name
            out.append((name, keys))
        if not out:
            raise DataError(f"{self.path}: the workbook has no sheets; add data sheets")
        return out

    def _columns(self, sheet: str, header: Row) -> tuple[int, int, list[tuple[str, int]]]:
        lay, where = self.lay, f"{self.path} sheet {sheet!r}"
        names = [str(h).strip() if h is not None else "" for h in header]
        dup = sorted({n for n in names if n and names.count(n) > 1})
        if dup:
            raise DataError(f"{where}: duplicate column {dup[0]!r}; rename one of them")
        times = []
        for j, n in enumerate(names):
            m = self.time_re.match(n)
            if m:
                times.append((m.group("hour"), j))
            elif n not in lay.row_keys and n not in lay.ignore_columns and n:
                raise DataError(
                    f"{where} column {n!r}: not in the layout; "
                    "add it to data.workbook.ignore_columns "
                    "or fix data.workbook.time_pattern / row_keys"
                )
        for col in lay.row_keys:
            if col not in names:
                raise DataError(
                    f"{where}: missing column {col!r} (data.workbook.row_keys); "
                    "fix the sheet or the layout"
                )
        if not times and self.labels:
            raise DataError(
                f"{where}: no hour columns matching "
                f"data.workbook.time_pattern {lay.time_pattern!r}; "
                "add them, or set data.features_only=true to stage new inputs"
            )
        times.sort(key=lambda t: int(t[0]) if t[0].isdigit() else t[0])
        return names.index(lay.section_column), names.index(lay.direction_column), times

    def _read_sheet(self, sheet: str, first: bool = False) -> dict[str, np.ndarray]:
        """{direction: [sections, hours] grid} for one sheet, checked against the first sheet."""
        where = f"{self.path} sheet {sheet!r}"
        rows = _safe_rows(self.wb[sheet].iter_rows(values_only=True), where)
        header = next(rows, None)
        if header is None:
            raise DataError(f"{where}: empty sheet; add the header and data rows")
        si, di, times = self._columns(sheet, header)
        self._check_hours([h for h, _ in times], first, where)
        cells, order = self._read_cells(rows, header, si, di, times, where)
        if not cells:
            raise DataError(f"{where}: empty table (no data rows); add data rows")
        if first:
            self.sections = order
        if not self.labels:
            return {d: np.empty((0,)) for d in cells}
        return {d: self._grid(d, cells, where) for d in cells}

    def _check_hours(self, hours: list[str], first: bool, where: str) -> None:
        """The first sheet sets the hour columns; every later sheet must have the same."""
        if first:
            self.hours = hours
        elif self.labels and hours != self.hours:
            gone = sorted(set(self.hours) - set(hours)) or sorted(set(hours) - set(self.hours))
            raise DataError(
                f"{where}: hour columns differ from the first sheet (hour {gone[0]}); fix the sheet"
            )

    def _read_cells(
        self,
        rows: Iterator[Row],
        header: Row,
        si: int,
        di: int,
        times: list[tuple[str, int]],
        where: str,
    ) -> tuple[dict[str, dict[str, list[float]]], list[str]]:
        """({direction: {section: hour values}} of the data rows, sections in order of first
        appearance)."""
        cells: dict[str, dict[str, list[float]]] = {}
        order: list[str] = []
        for r, row in enumerate(rows, start=2):
            if row is None or all(v is None for v in row):
                continue
            sec = canonical_section(row[si], self.lay, f"{where} row {r}")
            d = str(row[di]).strip() if row[di] is not None else ""
            if not d:
                raise DataError(
                    f"{where} row {r} column {self.lay.direction_column!r}: "
                    "empty direction; fill it"
                )
            per = cells.setdefault(d, {})
            if sec in per:
                raise DataError(
                    f"{where} row {r}: duplicate section {sec!r} in direction {d!r}; remove the row"
                )
            per[sec] = _hour_values(row, header, times, f"{where} row {r}")
            if sec not in order:
                order.append(sec)
        return cells, order

    def _grid(self, d: str, cells: dict[str, dict[str, list[float]]], where: str) -> np.ndarray:
        """Direction d's [sections, hours] grid, in the first sheet's section order."""
        per = cells[d]
        for sec in self.sections:
            if sec not in per:
                other = next((o for o in cells if sec in cells[o]), None)
                how = f"present only in direction {other!r}" if other else "missing"
                raise DataError(
                    f"{where}: section {sec!r} is {how}, not in {d!r}; "
                    "every section needs both directions"
                )
        extra = [s for s in per if s not in self.sections]
        if extra:
            raise DataError(
                f"{where}: section {extra[0]!r} is not in the first sheet; "
                "sheets must share sections"
            )
        return np.array([per[s] for s in self.sections], dtype=np.float64)

    def chunks(self) -> Iterator[Chunk]:
        row = 0
        for k, (sheet, keys) in enumerate(self.sheets):
            grids = self._first if k == 0 else self._read_sheet(sheet)
            dirs = list(grids)
            n = len(dirs)
            full = [{**keys, self.lay.direction_key: d} for d in dirs]
            cols = {g: np.array([f[g] for f in full], dtype=object) for g in self.lay.group_keys}
            y = np.stack([grids[d] for d in dirs]) if self.labels else None

            def where(i: int, s: str = sheet, ds: list[str] = dirs) -> str:
                return f"sheet {s!r} direction {ds[i]!r}"

            yield Chunk(start=row, cols=cols, y=y, keys=dict(cols), where=where)
            row += n

    def label_name(self, j: int) -> str:
        s, h = divmod(j, len(self.hours))
        return f"section {self.sections[s]!r} hour {self.hours[h]!r}"

    def close(self) -> None:
        self.wb.close()
