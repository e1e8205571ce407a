"""The report: exit code, table and JSON; `--only` parsing; main() output."""

from __future__ import annotations

import io
import json

import pytest

from enn_core.doctor import main, parse_only
from enn_core.doctor.report import Check, Report
from enn_core.errors import ConfigError
from tests.fixtures.doctor import make_config


def _report(*statuses: str) -> Report:
    checks = [Check("data", f"c{i}", s, f"detail {i}", f"fix {i}") for i, s in enumerate(statuses)]
    return Report(checks, device="cpu", quick=True, layers=["data"], seconds=1.0)


def test_exit_code_is_nonzero_only_on_a_fail():
    assert _report("ok", "warn", "skip").exit_code == 0
    assert _report("ok", "fail").exit_code == 1


def test_table_shows_status_detail_and_fix_of_problems_only():
    table = _report("ok", "warn", "fail").table(width=100)
    lines = table.splitlines()
    assert lines[0].split() == ["STATUS", "LAYER", "CHECK", "DETAIL"]
    assert any(ln.startswith("WARN") and "detail 1" in ln for ln in lines)
    assert any(ln.startswith("FAIL") and "detail 2" in ln for ln in lines)
    assert "fix: fix 1" in table and "fix: fix 2" in table and "fix: fix 0" not in table
    assert lines[-1].startswith("doctor FAILED: 1 ok, 1 warn, 1 fail")


def test_json_is_machine_readable():
    doc = json.loads(json.dumps(_report("ok", "fail").as_json()))
    assert doc["exit_code"] == 1 and doc["ok"] is False
    assert doc["counts"] == {"ok": 1, "warn": 0, "fail": 1, "skip": 0}
    assert doc["checks"][1] == {
        "layer": "data",
        "name": "c1",
        "status": "fail",
        "detail": "detail 1",
        "fix": "fix 1",
        "seconds": 0.0,
        "data": {},
    }


def test_unknown_status_and_unknown_layer_are_refused():
    with pytest.raises(ValueError, match="status"):
        Check("data", "x", "bad", "")
    with pytest.raises(ConfigError, match="unknown layer.*use some of data,model"):
        parse_only("data,gpu")
    assert parse_only("data, model") == ["data", "model"]
    assert parse_only(None) is None


def test_main_prints_json_and_returns_the_exit_code(layout):
    out = io.StringIO()
    code = main(make_config(), layout, quick=True, as_json=True, only="distributed", out=out)
    doc = json.loads(out.getvalue())
    assert code == doc["exit_code"] == 0
    assert [c["name"] for c in doc["checks"]] == ["backend", "world size", "timeouts"]
    assert doc["layers"] == ["distributed"]
