"""Fixtures of the stage-data tests (helpers: tests/fixtures/data.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.data import write_workbook


@pytest.fixture
def small_workbook(tmp_path) -> Path:
    return write_workbook(tmp_path / "wb.xlsx")
