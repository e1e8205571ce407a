"""The lint budgets hold over the whole repository (pyproject.toml): `ruff check .` (line
length, complexity, arguments, imports, ...), `ruff format --check .`, mypy on the files
[tool.mypy] names (enn_core, tasks and flows, its incremental cache under work/), and no
product file over MAX_LINES lines. Each tool runs as `python -m <tool>` from the repository
root, in a subprocess; a failure shows the tool's output."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from tests.fixtures.project import ROOT

MAX_LINES = 600
PRODUCT = ("enn_core", "tasks", "flows", "examples")  # what users run and build on
# Files allowed over MAX_LINES for now, each with the branch that splits it.
OVER_FOR_NOW: set[str] = set()
# Modules whose type errors mypy reports nowhere, each with the branch that fixes them.
UNCHECKED_FOR_NOW: set[str] = set()


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


@pytest.mark.timeout(330)
def test_mypy_finds_no_error_in_the_configured_files():
    # A clean clone's cold cache: 82 s alone on a 2-core machine at load 10, 128 s at load 15,
    # and past 230 s there beside the rest of the fast tier; a warm cache: 2 s. The deadline
    # only proves it ends, within the tier's budget (scripts/test.sh).
    run_clean("mypy", timeout=320)


def test_mypy_checks_every_product_package_and_hides_no_error():
    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert sorted(mypy["files"]) == ["enn_core", "flows", "tasks"]
    assert mypy["cache_dir"].startswith("work/")  # state under work/, never in the tree
    hidden = {
        module
        for override in mypy.get("overrides", [])
        if override.get("ignore_errors")
        for module in override["module"]
    }
    assert hidden == UNCHECKED_FOR_NOW, (
        "pyproject.toml's [[tool.mypy.overrides]] with ignore_errors must name only "
        f"{sorted(UNCHECKED_FOR_NOW)}; fix the type errors instead of hiding {sorted(hidden)}"
    )


def test_no_product_file_is_over_the_line_budget():
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
        for package in PRODUCT
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    new = [f"{name} ({over[name]} lines)" for name in sorted(over.keys() - OVER_FOR_NOW)]
    assert not new, f"over {MAX_LINES} lines; split by what changes together: {new}"
    fixed = sorted(OVER_FOR_NOW - over.keys())
    assert not fixed, f"{fixed} within {MAX_LINES} lines now; remove from OVER_FOR_NOW"
