"""Property-based bad input: malformed CSV, .npy, Parquet and workbook files and out-of-range
`--set` values, each through `enn` itself (in-process), must give an exit code from the
documented list, exactly one error line and no traceback, and leave `outputs/` and
`params.yaml` byte for byte as they were.

Hypothesis runs derandomized here (the `ci` profile, tests/unit/fuzz/conftest.py): the same
examples on every machine; `HYPOTHESIS_PROFILE=explore` searches with fresh randomness.
"""

from __future__ import annotations

import datetime
import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enn_core.errors import exit_codes
from tests.fixtures.cli import enn

DOCUMENTED = set(exit_codes()) - {0}
HEADER = ["region", "x1", "x2", "y1", "y2"]
DATA = {
    "source": "csv",
    "feature_columns": ["region", "x1", "x2"],
    "categorical": ["region"],
    "cyclic": [],
    "cyclic_periods": [],
    "cyclic_starts": [],
    "label_columns": ["y1", "y2"],
    "label_shape": [2],
    "label_axes": ["out"],
    "naive_keys": ["region"],
    "val_fraction": 0.2,
    "test_fraction": 0.2,
}
PARAMS = {"data": DATA, "tracking": {"enabled": False}, "runtime": {"progress": False}}


def good_rows(n: int = 30) -> list[list[str]]:
    rng = np.random.default_rng(0)
    return [
        [["north", "south", "east"][i % 3], *(f"{v:.4f}" for v in rng.normal(size=4))]
        for i in range(n)
    ]


@dataclass
class Project:
    root: Path
    # outputs/ and params.yaml after the good staging (left out of the repr hypothesis prints)
    before: dict[str, bytes] = field(repr=False)

    def snapshot(self) -> dict[str, bytes]:
        files = [self.root / "params.yaml", *sorted((self.root / "outputs").rglob("*"))]
        return {str(p.relative_to(self.root)): p.read_bytes() for p in files if p.is_file()}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Project:
    """A project whose good CSV is staged: every malformed input must leave it as it is."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "good.csv").write_text(
        "\n".join([",".join(HEADER)] + [",".join(r) for r in good_rows()]) + "\n"
    )
    (root / "params.yaml").write_text(
        yaml.safe_dump({**PARAMS, "data": {**DATA, "path": "good.csv"}})
    )
    code, lines = enn(root, "stage-data")
    assert code == 0, lines
    project = Project(root, {})
    project.before = project.snapshot()
    return project


def restore(project: Project) -> None:
    """Put outputs/ and params.yaml back as they were (a failing example must not make the
    next one fail)."""
    now = project.snapshot()
    for name in set(now) - set(project.before):
        (project.root / name).unlink()
    for name, data in project.before.items():
        if now.get(name) != data:
            (project.root / name).write_bytes(data)


def refused(project: Project, *argv: str) -> str:
    try:
        return _refused(project, *argv)
    finally:
        restore(project)


def _refused(project: Project, *argv: str) -> str:
    code, lines = enn(project.root, *argv)
    assert code in DOCUMENTED, (code, lines)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in lines[0]
    now = project.snapshot()
    changed = sorted(
        k for k in set(now) | set(project.before) if now.get(k) != project.before.get(k)
    )
    assert changed == [], f"{argv} (exit {code}) changed {changed}"
    return lines[0]


def stage(project: Project, name: str, content: bytes, **data: object) -> str:
    (project.root / name).write_bytes(content)
    sets = [f"--set=data.{k}={v}" for k, v in {"path": name, **data}.items()]
    return refused(project, "stage-data", *sets)


def at(draw: st.DrawFn, data: bytes) -> int:
    """A position in `data`, drawn as a fraction: the draws stay the same when a file's size
    varies by a byte between runs (a workbook's zip timestamps)."""
    return int(draw(st.floats(0, 1, exclude_max=True)) * len(data))


SETTINGS = settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# -- CSV --------------------------------------------------------------------------------------

BAD_CELL = st.sampled_from(
    ["nan", "inf", "-inf", "1e300", "-4e39", "warm", "", "1,5", '"', "0x1F", "\u00e9t\u00e9"]
)


@st.composite
def malformed_csv(draw: st.DrawFn) -> bytes:
    rows = good_rows()
    for _ in range(draw(st.integers(1, 3))):
        r = draw(st.integers(0, len(rows) - 1))
        kind = draw(st.sampled_from(["cell", "short", "long", "latin1"]))
        if kind == "cell":
            rows[r][draw(st.integers(1, len(rows[r]) - 1))] = draw(BAD_CELL)
        elif kind == "short" and len(rows[r]) > 2:
            rows[r] = rows[r][: draw(st.integers(2, len(rows[r]) - 1))]
        elif kind == "long":
            rows[r] = [*rows[r], "7"]
        else:
            rows[r][0] = "caf\u00e9"
    text = "\n".join([",".join(HEADER)] + [",".join(r) for r in rows]) + "\n"
    encoding = "latin-1" if any("caf\u00e9" in r for r in rows) else "utf-8"
    data = text.encode(encoding)
    if draw(st.booleans()):  # or the header itself is off
        data = data.replace(b"y2", draw(st.sampled_from([b"y1", b"", b"y 2"])), 1)
    return data


@SETTINGS
@given(content=malformed_csv())
def test_malformed_csv(project, content):
    msg = stage(project, "bad.csv", content)
    assert "bad.csv" in msg or "data." in msg


# -- .npy ---------------------------------------------------------------------------------------


@st.composite
def malformed_npy(draw: st.DrawFn) -> bytes:
    x = np.random.default_rng(1).normal(size=(30, 3)).astype(draw(st.sampled_from(["f4", "f8"])))
    kind = draw(st.sampled_from(["truncate", "value", "shape", "header", "object"]))
    if kind == "value":
        x = x.astype(np.float64)
        x[draw(st.integers(0, 29)), draw(st.integers(0, 2))] = draw(
            st.sampled_from([np.nan, np.inf, 1e300, -3.5e39])
        )
    elif kind == "shape":
        x = x.reshape(draw(st.sampled_from([(30, 3, 1), (90,)])))
    buf = io.BytesIO()
    if kind == "object":
        np.save(buf, np.array([{"a": 1}] * 30, dtype=object), allow_pickle=True)
        return buf.getvalue()
    np.save(buf, x)
    data = buf.getvalue()
    if kind == "truncate":
        return data[: at(draw, data)]
    if kind == "header":  # a byte of the magic, version or header text that no header holds there
        i = draw(st.integers(0, data.index(b"\n")))
        bad = draw(
            st.sampled_from([b"\x00", b"{", b"}", b"'", b"(", b"\xff"]).filter(
                lambda b: b != data[i : i + 1]
            )
        )
        return data[:i] + bad + data[i + 1 :]
    return data


@SETTINGS
@given(content=malformed_npy())
def test_malformed_npy(project, content):
    y = np.random.default_rng(2).normal(size=(30, 2)).astype(np.float32)
    np.save(project.root / "y.npy", y)
    stage(
        project,
        "bad.npy",
        content,
        source="npy",
        labels_path="y.npy",
        feature_columns="[]",
        categorical="[]",
        naive_keys="[]",
    )


# -- Parquet ------------------------------------------------------------------------------------


@st.composite
def malformed_parquet(draw: st.DrawFn) -> bytes:
    rows = good_rows()
    cols = {h: [r[i] for r in rows] for i, h in enumerate(HEADER)}
    table = {"region": cols["region"], **{h: [float(v) for v in cols[h]] for h in HEADER[1:]}}
    kind = draw(st.sampled_from(["bytes", "missing", "text", "value"]))
    if kind == "missing":
        del table[draw(st.sampled_from(HEADER))]
    elif kind == "text":
        table[draw(st.sampled_from(HEADER[1:]))] = ["warm"] * len(rows)
    elif kind == "value":
        col = table[draw(st.sampled_from(HEADER[1:]))]
        col[draw(st.integers(0, len(rows) - 1))] = draw(st.sampled_from([np.nan, 1e300, -np.inf]))
    buf = io.BytesIO()
    pq.write_table(pa.table(table), buf)
    data = buf.getvalue()
    if kind == "bytes":  # cut short: the footer, which every reader needs, is gone or broken
        i = at(draw, data)
        return data[:i] + draw(st.binary(max_size=4))
    return data


@SETTINGS
@given(content=malformed_parquet())
def test_malformed_parquet(project, content):
    stage(project, "bad.parquet", content, source="parquet")


# -- workbook -----------------------------------------------------------------------------------


@st.composite
def malformed_workbook(draw: st.DrawFn) -> bytes:
    import openpyxl

    wb = openpyxl.Workbook()
    wb.properties.created = wb.properties.modified = datetime.datetime(2026, 1, 1)  # same bytes
    ws = wb.active
    kind = draw(st.sampled_from(["bytes", "sheet", "cell", "empty"]))
    ws.title = "01월 월요일" if kind != "sheet" else draw(st.sampled_from(["Sheet1", "13월 x"]))
    if kind != "empty":
        ws.append(["구간", "방향", *[f"{h:02d}시" for h in range(3)]])
        for s in range(4):
            for d in ("상행", "하행"):
                ws.append([f"A-{s}", d, *[80.0 + s + h for h in range(3)]])
    if kind == "cell":
        ws.cell(row=draw(st.integers(2, 9)), column=draw(st.integers(3, 5)), value="fast")
    buf = io.BytesIO()
    wb.save(buf)
    data = buf.getvalue()
    if kind == "bytes":  # cut short: the zip's central directory is at its end
        i = at(draw, data)
        return data[:i] + draw(st.binary(max_size=4))
    return data


@SETTINGS
@given(content=malformed_workbook())
def test_malformed_workbook(project, content):
    stage(project, "bad.xlsx", content, source="workbook")


# -- --set values -------------------------------------------------------------------------------

OUT_OF_RANGE = st.sampled_from(
    [
        "train.epochs=0",
        "train.epochs=-3",
        "train.epochs=2.5",
        "train.lr=0",
        "train.lr=.inf",
        "train.lr=.nan",
        "train.lr=fast",
        "train.batch_size=0",
        "train.micro_batch=some",
        "train.memory_headroom=1.5",
        "train.min_lr_ratio=2",
        "data.val_fraction=1.5",
        "data.chunk_rows=0",
        "data.source=excel",
        "model.heads=0",
        "checkpoint.keep_last=0",
        "collapse.order=[raw,raw]",
        "export.formats=[tflite]",
        "export.example_batch=1",
        "runtime.world_size=-1",
        "train.epoch=3",
        "nosection.key=1",
        "train.lr",
    ]
)


@SETTINGS
@given(bad=OUT_OF_RANGE, command=st.sampled_from(["run", "stage-data", "distributed-train"]))
def test_out_of_range_set_values(project, bad, command):
    msg = refused(project, command, f"--set={bad}")
    key = bad.split("=")[0]
    assert key.split(".")[-1] in msg or "--set" in msg, msg
