"""Parquet keyed by row keys, and the workbook written back in the input's layout."""

from __future__ import annotations

import numpy as np
import openpyxl
import pyarrow as pa
import pyarrow.parquet as pq

from enn_core.config.data import WorkbookLayout
from enn_core.predict.outputs import cell_names, write_parquet, write_workbook

SECTIONS = ["A-B", "B-C"]  # canonical (sorted ends)
HOURS = ["00", "01", "02"]
AXES = ["section", "hour"]
AXIS_VALUES = {"section": SECTIONS, "hour": HOURS}


def _source_workbook(path):
    wb = openpyxl.Workbook()
    wb.remove(wb.active)
    for month in ("01", "02"):
        for day in ("일", "월"):
            ws = wb.create_sheet(f"{month}월 {day}요일")
            ws.append(["노선", "구간", "방향"] + [f"{h}시" for h in HOURS])
            for up, down in (("A-B", "B-A"), ("C-B", "B-C")):
                ws.append(["R1", up, "상행", 1.0, 2.0, 3.0])
                ws.append(["R1", down, "하행", 4.0, 5.0, 6.0])
    wb.create_sheet("notes")
    wb.save(path)


def _keys(groups):
    return pa.table(
        {k: [g[i] for g in groups] for i, k in enumerate(("month", "daytype", "direction"))}
    )


def test_cell_names_follow_the_label_axes():
    assert cell_names([2, 3], AXES, AXIS_VALUES)[:4] == ["A-B|00", "A-B|01", "A-B|02", "B-C|00"]
    assert cell_names([2], ["q"], {}) == ["q0", "q1"]


def test_parquet_is_keyed_by_row_keys(tmp_path):
    preds = np.arange(2 * 6, dtype=np.float32).reshape(2, 2, 3)
    keys = _keys([("01", "일", "상행"), ("02", "월", "하행")])
    write_parquet(
        tmp_path / "p.parquet",
        preds,
        keys,
        np.array([7, 3]),
        cell_names([2, 3], AXES, AXIS_VALUES),
        chunk_rows=1,
    )
    t = pq.read_table(tmp_path / "p.parquet").to_pandas()
    assert list(t.columns[:4]) == ["row", "month", "daytype", "direction"]
    assert t["row"].tolist() == [7, 3] and t["direction"].tolist() == ["상행", "하행"]
    assert t.loc[1, "B-C|01"] == preds[1, 1, 1]
    np.testing.assert_array_equal(t.iloc[:, 4:].to_numpy().reshape(2, 2, 3), preds)


def test_workbook_keeps_the_layout_and_replaces_hours(tmp_path):
    _source_workbook(tmp_path / "in.xlsx")
    groups = [("02", "월", "상행"), ("02", "월", "하행"), ("01", "일", "하행")]
    preds = np.random.default_rng(0).uniform(10, 150, size=(3, 2, 3)).astype(np.float32)
    info = write_workbook(
        tmp_path / "out.xlsx",
        tmp_path / "in.xlsx",
        WorkbookLayout(),
        preds,
        _keys(groups),
        AXIS_VALUES,
        AXES,
    )
    assert info == {"sheets": 2, "rows": 6}
    wb = openpyxl.load_workbook(tmp_path / "out.xlsx")
    assert wb.sheetnames == ["01월 일요일", "02월 월요일"]
    ws = wb["02월 월요일"]
    rows = list(ws.iter_rows(values_only=True))
    assert rows[0] == ("노선", "구간", "방향", "00시", "01시", "02시")
    assert rows[1][:3] == ("R1", "A-B", "상행") and np.allclose(rows[1][3:], preds[0, 0])
    assert rows[3][:3] == ("R1", "C-B", "상행") and np.allclose(
        rows[3][3:], preds[0, 1]
    )  # canonical B-C
    assert rows[4][:3] == ("R1", "B-C", "하행") and np.allclose(rows[4][3:], preds[1, 1])
    jan = list(wb["01월 일요일"].iter_rows(values_only=True))
    assert jan[1][3:] == (None, None, None)  # 01/일/상행 was not predicted
    assert np.allclose(jan[2][3:], preds[2, 0])
