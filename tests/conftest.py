"""Shared fixtures for every tier (their helpers live in tests/fixtures/project.py).

- `tiny_config`: a run config small enough for a test (synthetic data).
- `layout`: a project layout rooted in a temp dir (outputs/, work/).
- `project`: a temp git repo holding a copy of this project's code, with DVC initialised and
  a tiny params.yaml (`tests.fixtures.project.make_project`).
- `prefect_home_shared`: one Prefect home per test session, so the local API's migrations run once.
- `tmpfs`: mount a small tmpfs (full and read-only disks).

A test's folder gives its tier: everything under tests/distributed/ is marked `distributed`,
everything under tests/e2e/ `e2e` (tests/fixtures/tiers.py; checked by tests/unit/test_tiers.py).
A bare `pytest` (no `-m`, no paths) runs the fast tier only; `-m distributed`, `-m e2e` or a
named file selects the others (`bare_run_tiers`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.project import Project, make_project, tiny_overrides
from tests.fixtures.tiers import FAST, bare_run_tiers, tier_of

pytest_plugins = ["pytester"]  # tests/unit/test_tiers.py collects the suite in process


def pytest_configure(config: pytest.Config) -> None:
    """The test process is an entry point too: telemetry off before any test imports prefect
    or mlflow in-process (tasks/env.py's FORCED values; each project's commands get their own
    contained environment through `contained_env`)."""
    from tasks.env import FORCED

    os.environ.update(FORCED)
    if bare_run_tiers(config):
        config.option.markexpr = FAST


def pytest_report_header(config: pytest.Config) -> str | None:
    if config.option.markexpr == FAST and bare_run_tiers(config):
        return (
            "tiers: the fast tier only (a bare pytest); -m distributed, -m e2e or a file's "
            "path runs the others (scripts/test.sh runs all three)"
        )
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test gets the marker of its folder's tier (tests/distributed/, tests/e2e/)."""
    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(tier)


@pytest.fixture
def tiny_config():
    from enn_core.config import load_config

    return load_config(None, tiny_overrides(), allow_faults=True)


@pytest.fixture
def layout(tmp_path):
    from enn_core.paths import Layout

    (tmp_path / "params.yaml").write_text("{}\n")
    return Layout.for_root(tmp_path)


@pytest.fixture(scope="session")
def prefect_home_shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("prefect-home")


@pytest.fixture
def project(tmp_path, prefect_home_shared) -> Project:
    return make_project(tmp_path / "proj", prefect_home_shared)


@pytest.fixture
def tmpfs():
    """mount(path, size='1m', ro=False): a tmpfs at `path`, unmounted after the test (full
    and read-only disks; tests run as root, and skip only where mount is not permitted)."""
    mounted: list[Path] = []

    def mount(path: Path, size: str = "1m", ro: bool = False) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        opts = f"size={size}" + (",ro" if ro else "")
        out = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True
        )
        if out.returncode != 0:
            pytest.skip(f"mount -t tmpfs is not permitted here: {out.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)
