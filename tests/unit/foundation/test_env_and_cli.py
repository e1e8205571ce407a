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


@pytest.mark.timeout(120)
def test_environment_is_contained_before_imports(tmp_path):
    (tmp_path / "params.yaml").write_text("{}\n")
    code = (
        "import json, tasks, prefect, mlflow\n"
        "from prefect.settings import get_current_settings as g\n"
        "s = g()\n"
        "print(json.dumps({'home': str(s.home), 'storage': str(s.results.local_storage_path),"
        " 'serializer': s.results.default_serializer, 'mlflow': mlflow.get_tracking_uri(),"
        " 'analytics': s.server.analytics_enabled,"
        " 'env': {k: os.environ.get(k) for k in ['DO_NOT_TRACK', 'MLFLOW_DISABLE_TELEMETRY', 'DVC_NO_ANALYTICS']}}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import os\n" + code],
        cwd=tmp_path,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr
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
