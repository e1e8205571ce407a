"""Every bad input: a one-line error naming the place and the fix, a non-zero exit code, and
nothing written (the previous staged output stays byte-for-byte as it was)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from enn_core.config import SyntheticConfig, WorkbookLayout
from enn_core.errors import DataError, EnnError
from tests.fixtures.data import (
    TABLE_CFG,
    run_stage,
    table_rows,
    tree,
    write_npy_pair,
    write_table_csv,
    write_workbook,
)


@pytest.fixture
def previous(tmp_path):
    """A good staged output that every failed run must leave untouched."""
    small = SyntheticConfig(n_months=3, n_daytypes=2, n_sections=2, n_hours=3, n_replicates=2)
    _, out = run_stage(tmp_path, synthetic=small)
    return out, tree(out)


def refused(tmp_path, previous, match: str, **data) -> str:
    out, before = previous
    with pytest.raises(EnnError) as info:
        run_stage(tmp_path, **data)
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert info.value.exit_code != 0
    assert tree(out) == before  # nothing written
    assert sorted(p.name for p in out.parent.iterdir()) == ["stage-data"]  # no temp siblings left
    assert re.search(match, msg), msg
    return msg


def _csv(tmp_path, header=None, rows=None, name="t.csv"):
    h, r = table_rows(12)
    return str(write_table_csv(tmp_path / name, rows if rows is not None else r, header or h))


def test_missing_file(tmp_path, previous):
    refused(
        tmp_path,
        previous,
        r"data.path='nope.csv': expected the input at .*/nope.csv.*fix data.path",
        source="csv",
        path="nope.csv",
        **TABLE_CFG,
    )


def test_shared_directory_absent(tmp_path, previous):
    refused(
        tmp_path,
        previous,
        r"expected the input at .*/shared/data/x.xlsx.*directory .*/shared is absent",
        source="workbook",
        path="../shared/data/x.xlsx",
    )


def test_unknown_format(tmp_path, previous):
    (tmp_path / "t.json").write_text("{}")
    refused(
        tmp_path,
        previous,
        r"t.json: unknown format '.json' for data.source=csv; expected .csv",
        source="csv",
        path=str(tmp_path / "t.json"),
        **TABLE_CFG,
    )


def test_empty_table(tmp_path, previous):
    h, _ = table_rows(1)
    refused(
        tmp_path,
        previous,
        r"t.csv: empty table",
        source="csv",
        path=_csv(tmp_path, h, []),
        **TABLE_CFG,
    )


def test_missing_column(tmp_path, previous):
    refused(
        tmp_path,
        previous,
        r"t.csv: missing column 'y9'",
        source="csv",
        path=_csv(tmp_path),
        **{**TABLE_CFG, "label_columns": ("y0", "y9"), "label_shape": ()},
    )


def test_duplicate_column(tmp_path, previous):
    h, rows = table_rows(12)
    h[2] = "y0"
    refused(
        tmp_path,
        previous,
        r"t.csv: duplicate column 'y0'; rename",
        source="csv",
        path=_csv(tmp_path, h, rows),
        **TABLE_CFG,
    )


def test_non_numeric_cell(tmp_path, previous):
    h, rows = table_rows(12)
    rows[5][2] = "warm"
    refused(
        tmp_path,
        previous,
        r"t.csv line 7 column 'temp': non-numeric value 'warm'",
        source="csv",
        path=_csv(tmp_path, h, rows),
        **TABLE_CFG,
    )


def test_nan_in_features(tmp_path, previous):
    x, y = write_npy_pair(tmp_path, n=30, f=3, label_shape=(2,))
    xa = np.load(x)
    xa[21, 2] = np.nan
    np.save(x, xa)
    refused(
        tmp_path,
        previous,
        r"x.npy row 21 feature 'f2': NaN or infinite value; .*data.nonfinite=drop",
        source="npy",
        path=str(x),
        labels_path=str(y),
        chunk_rows=8,
    )


def test_infinity_in_labels(tmp_path, previous):
    h, rows = table_rows(12)
    rows[3][5] = "inf"
    refused(
        tmp_path,
        previous,
        r"t.csv line 5 column 'y2': NaN or infinite value",
        source="csv",
        path=_csv(tmp_path, h, rows),
        **TABLE_CFG,
    )


def test_ragged_rows(tmp_path, previous):
    path = tmp_path / "t.csv"
    path.write_text("a,b,y\n1,2,3\n4,5,6,7\n")
    refused(
        tmp_path,
        previous,
        r"t.csv: ragged row \(Expected 3 fields in line 3, saw 4\)",
        source="csv",
        path=str(path),
        label_columns=("y",),
        categorical=(),
    )


def test_label_shape_mismatch(tmp_path, previous):
    refused(
        tmp_path,
        previous,
        r"labels have 4 values per row \[4\] but data.label_shape=\[3, 3\]",
        source="csv",
        path=_csv(tmp_path),
        **{**TABLE_CFG, "label_shape": (3, 3)},
    )


def test_object_array_refused(tmp_path, previous):
    np.save(tmp_path / "x.npy", np.array([[1, "a"]], dtype=object), allow_pickle=True)
    np.save(tmp_path / "y.npy", np.ones(1))
    refused(
        tmp_path,
        previous,
        r"x.npy: holds an object array, which needs pickle and is refused",
        source="npy",
        path=str(tmp_path / "x.npy"),
        labels_path=str(tmp_path / "y.npy"),
    )


def test_feature_label_rows_differ(tmp_path, previous):
    np.save(tmp_path / "x.npy", np.ones((5, 2), np.float32))
    np.save(tmp_path / "y.npy", np.ones((4, 2), np.float32))
    refused(
        tmp_path,
        previous,
        r"y.npy: 4 label rows but .*x.npy has 5 feature rows",
        source="npy",
        path=str(tmp_path / "x.npy"),
        labels_path=str(tmp_path / "y.npy"),
    )


def test_sheet_name_not_in_layout(tmp_path, previous):
    wb = write_workbook(tmp_path / "wb.xlsx", sheets=["01월 일요일", "Sheet2"])
    refused(
        tmp_path,
        previous,
        r"wb.xlsx sheet 'Sheet2': name does not match data.workbook.sheet_pattern",
        source="workbook",
        path=str(wb),
    )


def test_sheet_columns_not_in_layout(tmp_path, previous):
    hours = [f"{h:02d}시" for h in range(24)]
    wb = write_workbook(tmp_path / "wb.xlsx", header=["노선", "구간", "방향", *hours[:-1], "비고"])
    refused(
        tmp_path,
        previous,
        r"wb.xlsx sheet '01월 일요일' column '비고': not in the layout; "
        r"add it to data.workbook.ignore_columns",
        source="workbook",
        path=str(wb),
    )


def test_duplicate_group_keys(tmp_path, previous):
    wb = write_workbook(tmp_path / "wb.xlsx", sheets=["01월 일요일", "01월 일요일 (2)"])
    refused(
        tmp_path,
        previous,
        r"sheets '01월 일요일' and '01월 일요일 \(2\)': duplicate group keys",
        source="workbook",
        path=str(wb),
        workbook=WorkbookLayout(sheet_pattern=r"^(?P<month>\d{2})월 (?P<daytype>\S)요일.*$"),
    )


def test_section_in_only_one_direction(tmp_path, previous):
    from tests.fixtures.data import default_rows

    def rows(name):
        r = default_rows(["A-B", "B-C"], 24, np.random.default_rng(0))
        return r[:-1]  # drop the down row of B-C

    wb = write_workbook(tmp_path / "wb.xlsx", rows_of=rows)
    refused(
        tmp_path,
        previous,
        r"wb.xlsx sheet '01월 일요일': section 'B-C' is present only in direction '상행', "
        r"not in '하행'",
        source="workbook",
        path=str(wb),
    )


def test_missing_hour_columns(tmp_path, previous):
    wb = write_workbook(tmp_path / "wb.xlsx", hours=[])
    refused(
        tmp_path,
        previous,
        r"wb.xlsx sheet '01월 일요일': no hour columns .*data.features_only=true",
        source="workbook",
        path=str(wb),
    )


def test_error_type_is_data_error(tmp_path):
    with pytest.raises(DataError):
        run_stage(tmp_path, source="csv", path="missing.csv", label_columns=("y",))


# -- values, encodings and shapes that used to pass or give a traceback (issue 16) -----------


@pytest.mark.parametrize(
    "row, col, value, match",
    [
        (5, 2, "1e300", r"t.csv line 7 feature 'temp': 1e\+300 is beyond float32's range"),
        (5, 4, "3.5e39", r"t.csv line 7 column 'y1': 3.5e\+39 is beyond float32's range"),
    ],
    ids=["feature", "label"],
)
def test_values_beyond_float32_are_refused_with_row_and_column(
    tmp_path, previous, row, col, value, match
):
    h, rows = table_rows(12)
    rows[row][col] = value
    msg = refused(
        tmp_path, previous, match, source="csv", path=_csv(tmp_path, h, rows), **TABLE_CFG
    )
    assert "rescale the column" in msg


def test_float64_npy_beyond_float32_is_refused(tmp_path, previous):
    x, y = write_npy_pair(tmp_path, n=30, f=3, label_shape=(2,))
    xa = np.load(x).astype(np.float64)
    xa[11, 1] = 1e300
    np.save(x, xa)
    refused(
        tmp_path,
        previous,
        r"x.npy row 11 feature 'f1': 1e\+300 is beyond float32's range",
        source="npy",
        path=str(x),
        labels_path=str(y),
    )


def test_truncated_npy_names_the_file_and_its_size(tmp_path, previous):
    x, y = write_npy_pair(tmp_path, n=30, f=3, label_shape=(2,))
    x.write_bytes(x.read_bytes()[:200])
    refused(
        tmp_path,
        previous,
        r"x.npy: truncated \(200 bytes, its header promises \(30, 3\).*re-write or re-copy",
        source="npy",
        path=str(x),
        labels_path=str(y),
    )


def test_latin1_csv_names_the_encoding_line_and_the_fix(tmp_path, previous):
    h, rows = table_rows(12)
    rows[4][0] = "caf\u00e9"
    path = tmp_path / "t.csv"
    path.write_bytes(
        ("\n".join([",".join(h)] + [",".join(map(str, r)) for r in rows]) + "\n").encode("latin-1")
    )
    refused(
        tmp_path,
        previous,
        r"t.csv line 6: byte 0xe9 is not valid utf-8; .*set data.encoding",
        source="csv",
        path=str(path),
        **TABLE_CFG,
    )
    _, out = run_stage(tmp_path, source="csv", path=str(path), encoding="latin-1", **TABLE_CFG)
    specs = json.loads((out / "manifest.json").read_text())["feature_specs"]
    assert "caf\u00e9" in next(s for s in specs if s["name"] == "region")["vocab"]


def test_every_row_dropped_is_an_empty_table(tmp_path, previous):
    path = tmp_path / "t.csv"
    path.write_text("a,b,y\n" + "nan,1,2\n" * 20)
    refused(
        tmp_path,
        previous,
        r"t.csv: empty table \(all rows had non-finite values and were dropped\)",
        source="csv",
        path=str(path),
        label_columns=("y",),
        categorical=(),
        nonfinite="drop",
    )


def test_a_short_row_is_reported_as_short_also_with_drop(tmp_path, previous):
    h, rows = table_rows(12)
    rows[6] = rows[6][:5]  # two label fields missing
    for nonfinite in ("error", "drop"):
        refused(
            tmp_path,
            previous,
            r"t.csv line 8: short row \(it has 5 fields, the header 7\); give it every field",
            source="csv",
            path=_csv(tmp_path, h, rows),
            nonfinite=nonfinite,
            **TABLE_CFG,
        )


def test_an_empty_cell_is_still_a_missing_value(tmp_path, previous):
    h, rows = table_rows(12)
    rows[6][3] = None  # "": the row has all its fields
    refused(
        tmp_path,
        previous,
        r"t.csv line 8 column 'y0': NaN or infinite value",
        source="csv",
        path=_csv(tmp_path, h, rows),
        **TABLE_CFG,
    )


def test_a_split_too_small_is_refused_at_stage_data(tmp_path, previous):
    path = tmp_path / "t.csv"
    path.write_text("a,b,y\n1,2,3\n")
    refused(
        tmp_path,
        previous,
        r"t.csv: the val split has 0 row\(s\) of 1; .*at least 2: add rows, or raise "
        r"data.val_fraction",
        source="csv",
        path=str(path),
        label_columns=("y",),
        categorical=(),
        naive_keys=(),
    )


def test_naive_keys_naming_a_missing_column_is_refused(tmp_path, previous):
    refused(
        tmp_path,
        previous,
        r"data.naive_keys names \['weekday'\], which are not row-key columns of this data "
        r"\(\['region', 'month'\]",
        source="csv",
        path=_csv(tmp_path),
        naive_keys=("weekday",),
        **TABLE_CFG,
    )


def test_label_axes_of_another_length_than_the_labels_is_refused(tmp_path, previous):
    refused(
        tmp_path,
        previous,
        r"data.label_axes names 3 axes \['a', 'b', 'c'\] but the labels have shape \[2, 2\]",
        source="csv",
        path=_csv(tmp_path),
        label_axes=("a", "b", "c"),
        **TABLE_CFG,
    )


def test_outputs_follow_the_umask(tmp_path):
    import os

    old = os.umask(0o027)
    try:
        _, out = run_stage(tmp_path, source="csv", path=_csv(tmp_path), **TABLE_CFG)
    finally:
        os.umask(old)
    assert oct(out.stat().st_mode & 0o777) == oct(0o750)
    assert oct((out / "manifest.json").stat().st_mode & 0o777) == oct(0o640)
