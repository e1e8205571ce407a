"""Helpers of the doctor tests: staged synthetic data in a project layout and a config."""

from __future__ import annotations

from pathlib import Path

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
