"""The lint budgets hold over the whole repository (pyproject.toml): `ruff check .` (line
length, complexity, arguments, imports, ...), `ruff format --check .`, and mypy on the files
[tool.mypy] names. Each runs as `python -m <tool>` from the repository root, in a subprocess;
a failure shows the tool's output."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.fixtures.project import ROOT


def run_clean(*args: str, timeout: float) -> None:
    """`python -m <args>` from the repository root exits 0, or the test fails with its output."""
    out = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode != 0:
        pytest.fail(
            f"python -m {' '.join(args)} exited {out.returncode}:\n{out.stdout}{out.stderr}",
            pytrace=False,
        )


@pytest.mark.timeout(60)
def test_ruff_check_is_clean():
    run_clean("ruff", "check", ".", timeout=55)


@pytest.mark.timeout(60)
def test_ruff_format_leaves_every_file_as_it_is():
    run_clean("ruff", "format", "--check", ".", timeout=55)


@pytest.mark.timeout(240)
def test_mypy_finds_no_error_in_the_configured_files():
    run_clean("mypy", timeout=230)
