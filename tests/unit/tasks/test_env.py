"""Containment of Prefect/MLflow/DVC state and telemetry (tasks/env.py), in a fresh subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.project import ROOT, clean_env

IMPORT_EVERYTHING = """
import importlib, json, os, pkgutil, sys
before = dict(os.environ)
names = []
for pkg in ("enn_core", "tasks", "flows"):
    for m in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
        if not m.name.endswith("__main__"):
            importlib.import_module(m.name)
            names.append(m.name)
after = dict(os.environ)
changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
imported = [m for m in ("mlflow", "matplotlib", "onnxruntime") if m in sys.modules]
print(json.dumps({"modules": len(names), "changed": changed, "imported": imported}))
"""


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if "__pycache__" not in p.parts}


@pytest.mark.timeout(240)
def test_importing_any_module_writes_nothing_and_sets_no_environment_variable(tmp_path):
    """Every module of enn_core, tasks and flows, imported in a fresh process from a project
    folder: no environment variable changes, nothing is written there or in HOME, and the
    libraries whose import writes state (mlflow, matplotlib, onnxruntime) are not imported.
    Prefect, imported by the flow modules, keeps its home in PREFECT_HOME (given here)."""
    (tmp_path / "params.yaml").write_text("{}\n")
    home, prefect_home = tmp_path / "home", tmp_path / "prefect-home"
    home.mkdir()
    before = _files(tmp_path)
    env = clean_env(HOME=str(home), PREFECT_HOME=str(prefect_home), PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERYTHING],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["modules"] > 100
    assert info["changed"] == [] and info["imported"] == []
    written = {f for f in _files(tmp_path) - before if not f.startswith("prefect-home")}
    assert written == set(), written


@pytest.mark.timeout(120)
def test_the_entry_point_contains_the_environment_before_prefect_and_mlflow(tmp_path):
    """What `enn` does first (tasks.env.contain) puts Prefect's and MLflow's state under the
    project's work directory and turns telemetry off, before either is imported."""
    (tmp_path / "params.yaml").write_text("{}\n")
    code = (
        "import json, os\n"
        "from pathlib import Path\n"
        "from tasks.env import contain, project_layout\n"
        "contain(project_layout(Path.cwd(), 'work'))\n"
        "import prefect, mlflow\n"
        "from prefect.settings import get_current_settings as g\n"
        "s = g()\n"
        "print(json.dumps({'home': str(s.home), 'storage': str(s.results.local_storage_path),"
        " 'serializer': s.results.default_serializer, 'mlflow': mlflow.get_tracking_uri(),"
        " 'analytics': s.server.analytics_enabled,"
        " 'env': {k: os.environ.get(k) for k in ['DO_NOT_TRACK', 'MLFLOW_DISABLE_TELEMETRY',"
        " 'DVC_NO_ANALYTICS']}}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=clean_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr
    assert "stale" not in out.stderr  # contained before the imports, not after
    info = json.loads(out.stdout.strip().splitlines()[-1])
    work = str((tmp_path / "work").resolve())
    assert info["home"].startswith(work)
    assert info["storage"].startswith(work)
    assert info["serializer"] == "json"
    assert info["mlflow"] == f"sqlite:///{work}/mlflow/mlflow.db"
    assert info["analytics"] is False
    assert info["env"] == {
        "DO_NOT_TRACK": "true",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DVC_NO_ANALYTICS": "1",
    }


@pytest.mark.timeout(120)
def test_a_flow_that_reads_another_store_contains_again_without_a_warning(tmp_path):
    """Issue 54: the prediction job's console said `UserWarning: contain() called after
    importing ['mlflow']`. The flow downloads its model from the tracking server
    (use_store: MLflow's set_tracking_uri also exports MLFLOW_TRACKING_URI), then the run's
    stages contain the tools' environment again, which read that as a setting gone stale."""
    (tmp_path / "params.yaml").write_text("{}\n")
    other = f"sqlite:///{tmp_path / 'server.db'}"
    code = (
        "import json, os\n"
        "from pathlib import Path\n"
        "from tasks.env import TOOLS, contain, project_layout\n"
        "contain(project_layout(Path.cwd(), 'work'))\n"  # `enn`
        "import mlflow\n"  # while the temporary Prefect API starts
        "from tasks.tracking.uris import use_store\n"
        f"use_store({other!r})\n"  # the model from the registry (models.materialize)
        "contain(project_layout(Path.cwd(), 'work'), groups=(TOOLS,))\n"  # the run's stages
        "print(json.dumps({'fluent': mlflow.get_tracking_uri(),"
        " 'registry': mlflow.get_registry_uri(), 'env': os.environ['MLFLOW_TRACKING_URI']}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "default", "-c", code],
        cwd=tmp_path,
        env=clean_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr
    assert "contain() called" not in out.stderr, out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["fluent"] == info["registry"] == other  # the fluent API still on that store
    work = (tmp_path / "work").resolve()
    assert info["env"] == f"sqlite:///{work}/mlflow/mlflow.db"  # contain's, for subprocesses
