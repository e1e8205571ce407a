"""Helpers for the stage-data tests: run the stage on a temp project, write small inputs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import openpyxl
import pytest

from enn_core.config import DataConfig, RunConfig, WorkbookLayout
from enn_core.paths import Layout
from enn_core.stage import make_context
from enn_core.stages import STAGE_DATA

SHARED_WORKBOOK = Path(__file__).resolve().parents[4] / "shared" / "data" / "expressway_speeds.xlsx"


def run_stage(root: Path, **data_fields) -> tuple[dict, Path]:
    """Run stage-data through `run(cfg, ctx)` with DataConfig(**data_fields) under `root`."""
    from enn_core.data.staging import run

    cfg = dataclasses.replace(RunConfig(), data=DataConfig(**data_fields))
    ctx = make_context(cfg, Layout.for_root(root), STAGE_DATA, "t")
    return run(cfg, ctx), ctx.output()


def tree(path: Path) -> dict[str, bytes]:
    """Every file under `path` with its bytes (to prove a failed run wrote nothing)."""
    if not path.exists():
        return {}
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def write_npy_pair(
    d: Path, n: int = 50, f: int = 4, label_shape=(3, 2), seed: int = 0
) -> tuple[Path, Path]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, f)).astype(np.float32)
    y = rng.normal(size=(n, *label_shape)).astype(np.float32)
    np.save(d / "x.npy", x)
    np.save(d / "y.npy", y)
    return d / "x.npy", d / "y.npy"


def write_table_csv(path: Path, rows: list[list], header: list[str]) -> Path:
    lines = [",".join(header)] + [",".join("" if v is None else str(v) for v in r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def table_rows(n: int = 40, seed: int = 0) -> tuple[list[str], list[list]]:
    """A table with a categorical key, a cyclic month, a continuous feature and 4 labels."""
    rng = np.random.default_rng(seed)
    header = ["region", "month", "temp", "y0", "y1", "y2", "y3"]
    rows = []
    for i in range(n):
        rows.append(
            [
                ["north", "south", "east"][i % 3],
                f"{i % 12 + 1:02d}",
                round(float(rng.normal(10, 3)), 4),
            ]
            + [round(float(v), 4) for v in rng.normal(50, 5, 4)]
        )
    return header, rows


TABLE_CFG = {
    "categorical": ("region", "month"),
    "label_columns": ("y0", "y1", "y2", "y3"),
    "label_shape": (2, 2),
}

HOURS = [f"{h:02d}시" for h in range(24)]


def write_workbook(
    path: Path, *, sheets=None, sections=None, header=None, rows_of=None, hours=HOURS
) -> Path:
    """A small workbook in the expressway layout (2 months x 2 day types, 3 sections)."""
    sheets = sheets or ["01월 일요일", "01월 월요일", "02월 일요일", "02월 월요일"]
    sections = sections or ["A-B", "B-C", "C-D"]
    header = header or ["노선", "구간", "방향", *hours]
    wb = openpyxl.Workbook()
    wb.remove(wb.active)
    rng = np.random.default_rng(0)
    for name in sheets:
        ws = wb.create_sheet(name)
        ws.append(header)
        rows = rows_of(name) if rows_of else default_rows(sections, len(hours), rng)
        for r in rows:
            ws.append(r)
    wb.save(path)
    return path


def default_rows(sections, n_hours, rng) -> list[list]:
    rows = []
    for d in ("상행", "하행"):
        for s in sections:
            a, b = s.split("-")
            name = f"{a}-{b}" if d == "상행" else f"{b}-{a}"  # the down row names its ends reversed
            rows.append(
                ["R1", name, d, *[round(float(v), 3) for v in rng.uniform(40, 100, n_hours)]]
            )
    return rows


def workbook_layout(**kw) -> WorkbookLayout:
    return WorkbookLayout(**kw)


@pytest.fixture
def small_workbook(tmp_path) -> Path:
    return write_workbook(tmp_path / "wb.xlsx")
