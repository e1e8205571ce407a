"""Fixtures of the distributed tier (helpers: tests/fixtures/distributed.py)."""

import pytest

from tests.fixtures.distributed import make_project


@pytest.fixture(autouse=True)
def dist_env(monkeypatch):
    """Collective mismatches become immediate errors; one thread per worker on 2 cores."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture
def tiny_project(tmp_path):
    return make_project(tmp_path / "proj")
