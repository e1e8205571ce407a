"""Containment of Prefect/MLflow/DVC state and telemetry (fresh subprocess); CLI help; lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from enn_core.errors import LockError

ROOT = Path(__file__).resolve().parents[3]


def _clean_env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_", "MLFLOW_", "DVC_", "DO_NOT_TRACK", "ENN_"))
    }
    env.update(extra)
    return env


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
print(json.dumps({"modules": len(names), "changed": changed,
                  "imported": [m for m in ("mlflow", "matplotlib", "onnxruntime") if m in sys.modules]}))
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
    env = _clean_env(HOME=str(home), PREFECT_HOME=str(prefect_home), PYTHONPATH=str(ROOT))
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
        env=_clean_env(PYTHONPATH=str(ROOT)),
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


def test_cli_help_for_every_subcommand(capsys):
    from enn_core.stages import TRAINING
    from flows.cli import main

    for cmd in (*(s.name for s in TRAINING), "run"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert "--set KEY=VALUE" in text and "--config" in text, cmd
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "stage-data" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_console_script_reports_config_errors(tmp_path):
    (tmp_path / "params.yaml").write_text("train:\n  epoch: 3\n")
    enn = Path(sys.executable).parent / "enn"
    out = subprocess.run(
        [str(enn), "stage-data"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=55,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines == [
        f"error: {tmp_path / 'params.yaml'}: unknown config key 'train.epoch'; did you mean 'train.epochs'?"
    ]


@pytest.mark.timeout(60)
def test_lock_refuses_a_second_pipeline_run(tmp_path):
    from tasks.lock import pipeline_lock

    lock = tmp_path / "work" / "pipeline.lock"
    with pipeline_lock(lock, "first run"):
        with pipeline_lock(lock, "nested"):  # re-entrant in one process
            pass
        code = (
            "import sys; from pathlib import Path; from tasks.lock import pipeline_lock\n"
            f"with pipeline_lock(Path({str(lock)!r}), 'second'): pass\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=ROOT
        )
        assert out.returncode != 0
        assert "another pipeline run holds this work directory" in out.stderr
        assert f"pid {os.getpid()}" in out.stderr and "first run" in out.stderr
    with pipeline_lock(lock, "after release"):
        pass
    # an error inside the locked block releases the lock
    with pytest.raises(LockError):
        with pipeline_lock(lock, "a"):
            raise LockError("propagates")
    with pipeline_lock(lock, "free again"):
        pass


def test_project_root_of_a_config_is_its_pipeline_folder(tmp_path):
    """params.yaml and prediction/params.yaml are their pipelines' roots; an overlay config
    under configs/ runs in the project above it (its outputs, work/, relative data paths);
    a config with no dvc.yaml above it is its own project."""
    from enn_core.paths import project_root

    proj = tmp_path / "proj"
    for f in (
        "dvc.yaml",
        "params.yaml",
        "prediction/dvc.yaml",
        "prediction/params.yaml",
        "configs/expressway.yaml",
        "../loose/params.yaml",
    ):
        (proj / f).parent.mkdir(parents=True, exist_ok=True)
        (proj / f).write_text("{}\n")
    assert project_root(proj / "params.yaml") == proj
    assert project_root(proj / "prediction" / "params.yaml") == proj / "prediction"
    assert project_root(proj / "configs" / "expressway.yaml") == proj
    assert project_root(tmp_path / "loose" / "params.yaml") == tmp_path / "loose"


def test_exit_codes_are_listed_once_and_the_readme_shows_them():
    from enn_core.errors import exit_codes
    from flows.cli import build_parser

    codes = exit_codes()
    assert {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 75, 130, 143} == set(codes)
    readme = (ROOT / "README.md").read_text()
    for code, meaning in codes.items():
        assert f"| {code} | {meaning.replace('|', '/')} |" in readme, code
    epilog = build_parser().epilog or ""
    assert all(f"{code:>3}  {meaning}" in epilog for code, meaning in codes.items())
