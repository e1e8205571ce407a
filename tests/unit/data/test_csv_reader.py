"""A CSV is read by pyarrow's streaming reader, as pandas would read it: where pyarrow refuses
a row or a value (a field count, a spelling it does not take), pandas reads on from that
chunk, and staging gives the same output, or the same one-line error, as a pandas read."""

from __future__ import annotations

import json

import numpy as np
import pytest

from enn_core.data.dataset import StagedDataset
from enn_core.errors import DataError
from tests.fixtures.data import TABLE_CFG, run_stage, table_rows, tree, write_table_csv

# rows enough for several of pyarrow's blocks (64 KiB at least), in chunks of 500 rows
ROWS, CHUNK = 4000, 500


def _stage(tmp_path, rows, header, name="t.csv", **cfg):
    path = write_table_csv(tmp_path / name, rows, header)
    return run_stage(tmp_path / name[:-4], source="csv", path=str(path), **{**TABLE_CFG, **cfg})


def test_pandas_reads_on_from_the_chunk_pyarrow_refuses(tmp_path):
    """A quoted value after a space (pandas' skipinitialspace; to pyarrow, a comma inside the
    value splits the row) deep in the file: the staged data equals that of the value spelled
    plainly, which pyarrow reads; no row is lost or read twice."""
    header, rows = table_rows(ROWS)
    plain = [list(r) for r in rows]
    plain[3100][0] = '"far, east"'
    spaced = [list(r) for r in rows]
    spaced[3100][0] = ' "far, east"'
    _, a = _stage(tmp_path, plain, header, "plain.csv", chunk_rows=CHUNK)
    _, b = _stage(tmp_path, spaced, header, "spaced.csv", chunk_rows=CHUNK)
    da, db = StagedDataset(a), StagedDataset(b)
    assert db.n_rows == ROWS
    assert "far, east" in db.feature_specs[0]["vocab"]
    assert da.feature_specs == db.feature_specs
    np.testing.assert_array_equal(da.features, db.features)
    np.testing.assert_array_equal(da.labels, db.labels)
    assert da.row_keys.equals(db.row_keys)
    # the staged arrays are the same bytes (their hashes); only the source file differs
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    assert ma["files"] == mb["files"] and ma["content_hash"] == mb["content_hash"]


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda r: r[:5], r"t.csv line 3502: short row \(it has 5 fields, the header 7\)"),
        (lambda r: [*r, "7"], r"t.csv: ragged row \(Expected 7 fields in line 3502, saw 8\)"),
        (lambda r: [r[0], r[1], "warm", *r[3:]], r"t.csv line 3502 column 'temp': non-numeric"),
        (lambda r: [r[0], "13", *r[2:]], r"t.csv line 3502 column 'month': value '13' is outside"),
        (lambda r: [" NA", *r[1:]], r"t.csv line 3502 column 'region': empty or NaN value"),
        (lambda r: [*r[:4], "None", *r[5:]], r"t.csv line 3502 column 'y1': NaN or infinite"),
    ],
    ids=["short", "long", "text", "cycle", "missing-key", "missing-label"],
)
def test_a_bad_row_in_a_later_chunk_is_named_by_its_line(tmp_path, edit, match):
    header, rows = table_rows(ROWS)
    rows[3500] = edit(rows[3500])
    with pytest.raises(DataError, match=match) as info:
        _stage(tmp_path, rows, header, chunk_rows=CHUNK)
    assert "\n" not in str(info.value)
    assert tree(tmp_path / "t") == {}  # nothing staged


def test_spellings_read_as_pandas_reads_them(tmp_path):
    """Leading spaces, signs, exponents and the spellings of a missing value, as pandas reads
    them: a categorical or cyclic value with a space before it is the same value."""
    header = ["region", "month", "temp", "y0", "y1", "y2", "y3"]
    cells = ["+3", ".5", "5.", "1E+03", " 3.5", "3.5 ", "-0", "7"]
    rows = [[" north" if i % 2 else "north", " 03", c, 1, 2, 3, 4] for i, c in enumerate(cells)]
    _, out = _stage(tmp_path, rows, header, val_fraction=0.25, test_fraction=0.25)
    ds = StagedDataset(out)
    assert ds.feature_specs[0]["vocab"] == ["north"]
    assert ds.feature_specs[1]["vocab"][2] == "03"
    np.testing.assert_array_equal(ds.features[:, 1], 2.0)
    want = np.array([float(c) for c in cells], np.float32)
    np.testing.assert_array_equal(ds.features[:, 2], want)


def test_a_fold_column_of_numbers_is_keyed_as_numbers(tmp_path):
    """A fold column that is not a feature is typed as pandas types it: '07' is the number 7
    (its key "7"), as before pyarrow read the file."""
    header = ["region", "x", "y", "week"]
    rng = np.random.default_rng(0)
    rows = [
        [f"r{i % 3}", f"{v:.3f}", f"{2 * v:.3f}", f"{i % 4 + 6:02d}"]
        for i, v in enumerate(rng.normal(size=40))
    ]
    folds = (("6",), ("7",), ("8",), ("9",))
    _, out = _stage(
        tmp_path,
        rows,
        header,
        feature_columns=("region", "x"),
        categorical=("region",),
        cyclic=(),
        cyclic_periods=(),
        cyclic_starts=(),
        label_columns=("y",),
        label_shape=(1,),
        naive_keys=("region",),
        fold_key="week",
        folds=folds,
        test_fold=3,
        val_fold=0,
    )
    ds = StagedDataset(out)
    week = ds.row_keys["week"].astype(str).to_numpy()
    assert set(week) == {"6", "7", "8", "9"}
    assert set(week[np.asarray(ds.split("test"))]) == {"9"}


@pytest.mark.parametrize("spelling", ["-nan", "-NaN", "1.#IND", "1.#QNAN", "-1.#IND", "-1.#QNAN"])
def test_missing_spellings_that_start_as_numbers_do_read_as_missing(tmp_path, spelling):
    """pyarrow is not told these are missing (the lookup slowed every number's parse): a
    number column reads them as missing all the same (pyarrow's NaN, or pandas from the
    chunk pyarrow refuses), and a categorical column's value too."""
    header, rows = table_rows(ROWS)
    na, odd = [list(r) for r in rows], [list(r) for r in rows]
    # a feature cell, then a label cell, in later chunks
    na[700][2], odd[700][2] = "NA", spelling
    na[3300][5], odd[3300][5] = "NA", spelling
    _, a = _stage(tmp_path, na, header, "na.csv", chunk_rows=CHUNK, nonfinite="drop")
    _, b = _stage(tmp_path, odd, header, "odd.csv", chunk_rows=CHUNK, nonfinite="drop")
    da, db = StagedDataset(a), StagedDataset(b)
    assert db.n_rows == ROWS - 2
    np.testing.assert_array_equal(da.features, db.features)
    np.testing.assert_array_equal(da.labels, db.labels)
    assert da.row_keys.equals(db.row_keys)
    odd[3300][5] = "4.5"  # only the feature cell left missing: refused, naming its line
    with pytest.raises(DataError, match=r"t.csv line 702 feature 'temp': NaN or infinite"):
        _stage(tmp_path, odd, header, chunk_rows=CHUNK)
    odd[700][2], odd[1900][0] = "4.5", spelling  # a categorical value spelled so
    with pytest.raises(DataError, match=r"t.csv line 1902 column 'region': empty or NaN value"):
        _stage(tmp_path, odd, header, chunk_rows=CHUNK)
