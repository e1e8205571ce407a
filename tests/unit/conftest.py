"""Fixtures of the unit tests shared across folders (helpers: tests/fixtures/model.py and
tests/fixtures/train.py): a tiny model config and manifest (the model, checkpoint and
precision tests), one staged dataset per session (the training-loop and batch-probe tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from enn_core.config.model import ModelConfig
from tests.fixtures import train
from tests.fixtures.model import make_manifest


@pytest.fixture
def manifest() -> dict:
    return make_manifest()


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    return ModelConfig(d_model=16, heads=2, layers=2, embed_dim=4)


@pytest.fixture(scope="session")
def staged(tmp_path_factory) -> Path:
    """One tiny staged dataset for the whole session (read-only)."""
    return train.staged_dir(tmp_path_factory.mktemp("staged"), train.tiny_cfg())
