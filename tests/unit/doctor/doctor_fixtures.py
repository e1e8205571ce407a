"""Helpers and fixtures of the doctor tests: staged synthetic data in a project layout, a config, and
small tmpfs mounts (tests run as root; a test is skipped only where mount is not permitted)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from enn_core.config import load_config
from enn_core.doctor.context import DoctorContext
from tests.conftest import tiny_overrides


def make_config(*extra: str):
    return load_config(None, [*tiny_overrides(), *extra], allow_faults=True)


def staged(root: Path) -> Path:
    from enn_core.stages.demo import stage_synthetic

    return stage_synthetic(root, n_months=4, n_daytypes=2, n_sections=4, n_hours=6)


def context(layout, *extra: str, quick: bool = True) -> DoctorContext:
    return DoctorContext.create(make_config(*extra), layout, quick)


@pytest.fixture
def tmpfs():
    """mount(path, size='1m', ro=False): a tmpfs at `path`, unmounted after the test."""
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
