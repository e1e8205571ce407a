"""Workbook staging: the real expressway workbook, a differently laid-out one, features-only."""

from __future__ import annotations

import dataclasses

import blake3
import numpy as np
import openpyxl
import pytest
import yaml

from enn_core.config import RunConfig, load_config
from enn_core.data.dataset import StagedDataset
from enn_core.data.staging import stage_features
from enn_core.paths import Layout
from enn_core.stage import make_context
from enn_core.stages import STAGE_DATA
from tests.fixtures.data import SHARED_WORKBOOK, run_stage, write_workbook

needs_shared = pytest.mark.skipif(
    not SHARED_WORKBOOK.exists(), reason=f"{SHARED_WORKBOOK} is absent"
)
# parsing the real 84-sheet workbook takes 4-12 s on a shared 2-core machine
real_workbook = pytest.mark.slow


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    _, out = run_stage(root, source="workbook", path=str(SHARED_WORKBOOK))
    return root, StagedDataset(out)


@needs_shared
@real_workbook
def test_real_workbook_stages_168_x_39_x_24(real):
    _, ds = real
    m = ds.manifest
    assert ds.labels.shape == (168, 39, 24) and ds.features.shape == (168, 3)
    assert m.row_keys == ("month", "daytype", "direction")
    assert m.naive_keys == ("daytype", "direction")
    assert m.label_axes == ("section", "hour")
    assert m.label_axis_values["hour"] == [f"{h:02d}" for h in range(24)]
    assert len(set(m.label_axis_values["section"])) == 39
    specs = {s["name"]: s for s in m.feature_specs}
    assert specs["daytype"]["vocab"] == ["일", "월", "화", "수", "목", "금", "토"]
    assert specs["direction"]["vocab"] == ["상행", "하행"]
    whole = blake3.blake3(SHARED_WORKBOOK.read_bytes()).hexdigest()  # b3sum of the file
    assert m.source.hash == f"blake3:{whole}"
    assert 10 < ds.labels.min() and ds.labels.max() < 160
    assert abs(m.label_stats.mean - 85.4) < 2


@needs_shared
@real_workbook
def test_sections_canonicalised_so_both_directions_share_one_order(real):
    _, ds = real
    sections = ds.manifest.label_axis_values["section"]
    assert sections[0] == "성남IC-판교JC"  # "판교JC-성남IC" (up) and "성남IC-판교JC" (down) sorted
    wb = openpyxl.load_workbook(SHARED_WORKBOOK, read_only=True, data_only=True)
    rows = list(wb["01월 일요일"].iter_rows(values_only=True))
    wb.close()
    up = next(r for r in rows if r[1] == "판교JC-성남IC" and r[2] == "상행")
    down = next(r for r in rows if r[1] == "성남IC-판교JC" and r[2] == "하행")
    keys = ds.row_keys
    i_up = keys.index[(keys.month == "01") & (keys.daytype == "일") & (keys.direction == "상행")][0]
    i_down = keys.index[(keys.month == "01") & (keys.daytype == "일") & (keys.direction == "하행")][
        0
    ]
    np.testing.assert_allclose(ds.labels[i_up, 0], np.array(up[3:], np.float32))
    np.testing.assert_allclose(ds.labels[i_down, 0], np.array(down[3:], np.float32))


@needs_shared
@real_workbook
def test_features_only_real_workbook_without_hour_columns(real, tmp_path):
    root, ds = real
    # the workbook's sheets, sections and directions without its hour columns (rebuilt from the
    # staged keys rather than re-parsed: parsing the real file twice costs seconds)
    wb = openpyxl.Workbook(write_only=True)
    keys = ds.row_keys
    for month, daytype in dict.fromkeys(zip(keys.month, keys.daytype, strict=True)):
        ws = wb.create_sheet(f"{month}월 {daytype}요일")
        ws.append(["노선", "구간", "방향"])
        for direction in ("상행", "하행"):
            for section in ds.manifest.label_axis_values["section"]:
                ws.append(["수도권제1순환선", section, direction])
    wb.save(tmp_path / "new.xlsx")
    cfg = load_config(None, ["data.source=workbook", f"data.path={tmp_path / 'new.xlsx'}"])
    out = tmp_path / "features"
    stage_features(cfg.data, Layout.for_root(tmp_path), out, ds.path / "manifest.json")
    new = StagedDataset(out)
    assert new.labels is None and new.manifest.mode == "features_only"
    np.testing.assert_array_equal(new.features, ds.features)
    assert (
        new.feature_specs == ds.feature_specs
    )  # vocabularies and encodings reused, not recomputed
    assert new.manifest.label_axis_values == ds.manifest.label_axis_values
    assert new.manifest.training_content_hash == ds.fingerprint


def test_second_layout_stages_by_params_alone(tmp_path):
    """Other sheet-name pattern, other column names, another separator, an extra column."""
    hours = [f"h{h}" for h in range(24)]
    sheets = [f"M{m:02d}_{d}" for m in (3, 4, 5) for d in ("weekday", "weekend")]

    def rows(name):
        rng = np.random.default_rng(len(name))
        out = []
        for d in ("in", "out"):
            for a, b in (("X", "Y"), ("Y", "Z")):
                link = f"{a}~{b}" if d == "in" else f"{b}~{a}"
                out.append([link, f"note {a}", d, *rng.uniform(30, 90, 24).round(2)])
        return out

    path = write_workbook(
        tmp_path / "other.xlsx",
        sheets=sheets,
        header=["link", "note", "dir", *hours],
        rows_of=rows,
        hours=hours,
    )
    params = {
        "data": {
            "source": "workbook",
            "path": str(path),
            "categorical": ["month", "daytype", "dir"],
            "naive_keys": ["daytype", "dir"],
            "workbook": {
                "sheet_pattern": r"^M(?P<month>\d{2})_(?P<daytype>[a-z]+)$",
                "row_keys": ["link", "dir"],
                "section_column": "link",
                "direction_column": "dir",
                "direction_key": "dir",
                "section_separator": "~",
                "time_pattern": r"^h(?P<hour>\d{1,2})$",
                "group_keys": ["month", "daytype", "dir"],
                "ignore_columns": ["note"],
            },
        }
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    cfg = load_config(tmp_path / "params.yaml")
    from enn_core.data.staging import run

    run(cfg, make_context(cfg, Layout.for_root(tmp_path), STAGE_DATA, "t"))
    ds = StagedDataset(tmp_path / "outputs" / "stage-data")
    assert ds.labels.shape == (12, 2, 24)
    assert ds.manifest.label_axis_values["section"] == ["X~Y", "Y~Z"]
    assert ds.manifest.label_axis_values["hour"] == [str(h) for h in range(24)]
    assert ds.manifest.row_keys == ("month", "daytype", "dir")
    assert ds.feature_specs[0]["vocab"][2] == "03"
    r = rows("M03_weekday")
    np.testing.assert_allclose(
        ds.labels[1, 0], np.array(r[2][3:], np.float32)
    )  # "Y~X" out row -> X~Y


def test_small_workbook_features_only_refuses_unknown_value(tmp_path, small_workbook):
    _, out = run_stage(tmp_path, source="workbook", path=str(small_workbook), val_fraction=0.3)
    other = write_workbook(tmp_path / "new.xlsx", sheets=["03월 화요일"], hours=[])
    data = dataclasses.replace(RunConfig().data, source="workbook", path=str(other))
    from enn_core.errors import DataError

    with pytest.raises(
        DataError,
        match=r"new.xlsx sheet '03월 화요일'.*'daytype'.*'화' is not in the training vocabulary",
    ):
        stage_features(data, Layout.for_root(tmp_path), tmp_path / "f", out / "manifest.json")
    assert not (tmp_path / "f").exists()


BOMB = (
    '<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">'
    '<!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">'
    '<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">]>'
    '<worksheet xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main"><sheetData>'
    '<row r="1"><c r="A1" t="inlineStr"><is><t>&lol3;</t></is></c></row></sheetData></worksheet>'
)


@pytest.mark.timeout(60)
def test_xml_bomb_workbook_is_refused(tmp_path, small_workbook):
    import zipfile

    from enn_core.errors import DataError

    bad = tmp_path / "bomb.xlsx"
    with zipfile.ZipFile(small_workbook) as src, zipfile.ZipFile(bad, "w") as dst:
        for item in src.infolist():
            data = BOMB.encode() if item.filename == "xl/worksheets/sheet1.xml" else src.read(item)
            dst.writestr(item, data)
    with pytest.raises(DataError, match=r"bomb.xlsx.*refused unsafe XML \(EntitiesForbidden\)"):
        run_stage(tmp_path, source="workbook", path=str(bad))
    assert not (tmp_path / "outputs" / "stage-data").exists()
