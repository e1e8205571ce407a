"""End-to-end fixtures: one tiny project trained once per session, which tests copy
(`tests.fixtures.project.copy_project`) instead of training again."""

from __future__ import annotations

import pytest

from tests.fixtures.project import Trained, train_template

# The template's one training: the first champion of tests/e2e/test_models_in_mlflow.py.
TEMPLATE_OVERRIDES = ("train.epochs=12",)


@pytest.fixture(scope="session")
def trained_project(tmp_path_factory, prefect_home_shared) -> Trained:
    """A tiny project after `enn run --set train.epochs=12` (all seven stages, a registered
    champion): copy it, never change it."""
    root = tmp_path_factory.mktemp("trained") / "proj"
    return train_template(root, prefect_home_shared, TEMPLATE_OVERRIDES)
