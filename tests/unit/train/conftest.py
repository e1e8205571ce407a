"""Fixtures of the training tests (helpers: tests/fixtures/train.py)."""

from pathlib import Path

import pytest

from tests.fixtures.train import staged_dir, tiny_cfg


@pytest.fixture(scope="session")
def staged(tmp_path_factory) -> Path:
    """One tiny staged dataset for the whole session (read-only)."""
    return staged_dir(tmp_path_factory.mktemp("staged"), tiny_cfg())
