"""A workbook source comes back as a workbook: same sheets and rows, hours replaced."""

from __future__ import annotations

import numpy as np
import openpyxl
import pyarrow.parquet as pq

from enn_core.config import load_config
from enn_core.data import staging
from enn_core.paths import Layout
from enn_core.stage import make_context
from enn_core.stages import PREDICT, PREPARE_CHECKPOINT, STAGE_DATA

ENDS = [
    ("A", "B"),
    ("C", "B"),
    ("C", "D"),
]  # the up row names a section one way, the down row the other
HOURS = ["00", "01", "02", "03"]


def _workbook(path) -> None:
    rng = np.random.default_rng(0)
    wb = openpyxl.Workbook()
    wb.remove(wb.active)
    for month in ("01", "02", "03"):
        for day in ("일", "월"):
            ws = wb.create_sheet(f"{month}월 {day}요일")
            ws.append(["노선", "구간", "방향"] + [f"{h}시" for h in HOURS])
            for a, b in ENDS:
                ws.append(
                    ["R", f"{a}-{b}", "상행", *rng.uniform(40, 100, len(HOURS)).round(1).tolist()]
                )
            for a, b in ENDS:
                ws.append(
                    ["R", f"{b}-{a}", "하행", *rng.uniform(40, 100, len(HOURS)).round(1).tolist()]
                )
    wb.save(path)


def test_workbook_predictions_come_back_in_the_input_layout(tmp_path):
    (tmp_path / "params.yaml").write_text("{}\n")
    _workbook(tmp_path / "speeds.xlsx")
    cfg = load_config(
        None,
        [
            "data.source=workbook",
            "data.path=speeds.xlsx",
            "model.d_model=16",
            "model.heads=2",
            "model.layers=1",
            "predict.model=outputs/prepare-checkpoint/init.pt",
            "predict.split=all",
        ],
    )
    layout = Layout.for_root(tmp_path)
    staging.run(cfg, make_context(cfg, layout, STAGE_DATA, "r0"))
    PREPARE_CHECKPOINT.work(cfg, make_context(cfg, layout, PREPARE_CHECKPOINT, "r0"))
    s = PREDICT.work(cfg, make_context(cfg, layout, PREDICT, "r0"))
    out = tmp_path / "outputs/predict"
    assert "predictions.xlsx" in s.files
    pred = np.load(out / "predictions.npy")
    table = pq.read_table(out / "predictions.parquet").to_pandas()
    src = openpyxl.load_workbook(tmp_path / "speeds.xlsx", read_only=True)
    got = openpyxl.load_workbook(out / "predictions.xlsx", read_only=True)
    assert got.sheetnames == src.sheetnames
    for name in src.sheetnames:
        month, day = name[:2], name[4]
        src_rows = list(src[name].iter_rows(values_only=True))
        rows = list(got[name].iter_rows(values_only=True))
        assert len(rows) == len(src_rows) and rows[0] == src_rows[0]
        for r, (sr, gr) in enumerate(zip(src_rows[1:], rows[1:], strict=True)):
            assert gr[:3] == sr[:3]  # route, section as written, direction
            i = table.index[
                (table.month == month) & (table.daytype == day) & (table.direction == sr[2])
            ][0]
            section = r % len(ENDS)  # canonical order A-B, B-C, C-D = the sheet's order here
            np.testing.assert_allclose(gr[3:], pred[i, section], rtol=1e-6)
