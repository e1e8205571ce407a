"""collapse-check's report.json read back: the record round-trips, a wrong version is refused."""

from __future__ import annotations

import json

import pytest

from enn_core.collapse.report import (
    FORMAT_VERSION,
    REPORT_FILE,
    Candidate,
    Cause,
    CollapseReport,
    read_report,
)
from enn_core.errors import StaleOutputError


def report() -> CollapseReport:
    return CollapseReport(
        status="passed",
        chosen="raw",
        why="raw passes every criterion",
        order=("raw",),
        precision="fp32",
        n_rows=8,
        thresholds={"std_ratio": 0.5},
        candidates={"raw": Candidate(status="passed", metrics={"val/mae": 1.0})},
        cause=Cause(batch_dependence=0.0, batch_dependent=False, diagnosis="none"),
    )


def test_report_round_trips_through_its_file(tmp_path):
    (tmp_path / REPORT_FILE).write_text(json.dumps(report().to_json()))
    assert read_report(tmp_path) == report()


@pytest.mark.parametrize("version", [0, FORMAT_VERSION + 1])
def test_report_of_another_format_version_is_refused_in_one_line(tmp_path, version):
    rec = {**report().to_json(), "format_version": version}
    (tmp_path / REPORT_FILE).write_text(json.dumps(rec))
    with pytest.raises(StaleOutputError, match=r"format_version=.* this code reads") as e:
        read_report(tmp_path)
    assert str(tmp_path / REPORT_FILE) in str(e.value) and "\n" not in str(e.value)
    assert "re-run collapse-check" in str(e.value)
