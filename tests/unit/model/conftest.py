"""Fixtures of the model tests (helpers live in model_fixtures.py: unique module name)."""

from __future__ import annotations

import pytest
from model_fixtures import make_manifest

from enn_core.config.model import ModelConfig


@pytest.fixture
def manifest() -> dict:
    return make_manifest()


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    return ModelConfig(d_model=16, heads=2, layers=2, embed_dim=4)
