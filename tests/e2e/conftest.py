"""End-to-end fixtures: one tiny project trained once per test session, which tests copy
(`tests.fixtures.project.copy_project`) instead of training again.

The tiers run on pytest-xdist's workers (scripts/test.sh): the first worker that needs the
template trains it under a file lock in the session's shared temporary directory; the others
wait for it and load what it recorded, so it is trained once, not once per worker."""

from __future__ import annotations

import json
import os

import pytest
from filelock import FileLock

from tests.fixtures.project import Project, Trained, contained_env, train_template

# The template's one training: the first champion of tests/e2e/test_models_in_mlflow.py.
TEMPLATE_OVERRIDES = ("train.epochs=12",)


@pytest.fixture(scope="session")
def trained_project(tmp_path_factory, prefect_home_shared) -> Trained:
    """A tiny project after `enn run --set train.epochs=12` (all seven stages, a registered
    champion): copy it, never change it. Copies use this worker's Prefect home."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the directory every worker's base temp lives in
    root = shared / "trained" / "proj"
    record = root.parent / "trained.json"
    with FileLock(str(root.parent) + ".lock"):
        if not record.exists():
            root.parent.mkdir(parents=True, exist_ok=True)
            made = train_template(root, prefect_home_shared, TEMPLATE_OVERRIDES)
            record.write_text(json.dumps({"stdout": made.stdout, "stderr": made.stderr}))
    seen = json.loads(record.read_text())
    project = Project(root, contained_env(root, PREFECT_HOME=str(prefect_home_shared)))
    return Trained(project, seen["stdout"], seen["stderr"], TEMPLATE_OVERRIDES)
