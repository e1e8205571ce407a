"""Fixtures of the model tests (helpers: tests/fixtures/model.py)."""

from __future__ import annotations

import pytest

from enn_core.config.model import ModelConfig
from tests.fixtures.model import make_manifest


@pytest.fixture
def manifest() -> dict:
    return make_manifest()


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    return ModelConfig(d_model=16, heads=2, layers=2, embed_dim=4)
