"""The project's databases are its owner's alone and no folder it makes is world-writable,
whatever the umask: MLflow's store and a study's database are 0600 (they were 0644 under
umask 022; Prefect's is made the same way), DVC's site cache follows the umask (DVC makes it
0777), and under umask 000 nothing the tools make is world-writable. Real tools, in a fresh
process."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from tests.fixtures.project import ROOT, clean_env

MAKE_STORES = """
import json, os, stat, sys
from pathlib import Path
os.umask(int(sys.argv[2], 8))
root = Path(sys.argv[1])
from enn_core.config import load_config
from enn_core.paths import Layout
from tasks.env import contain
layout = contain(Layout.for_root(root))
from mlflow.tracking import MlflowClient
MlflowClient(layout.mlflow_uri).create_experiment("enn")
from tasks.tuning.study import make_plan, open_study
cfg = load_config(None, ['tune.space={"train.lr": {"low": 0.001, "high": 0.1}}'])
open_study(cfg, make_plan(cfg, root / "s.yaml", [], layout))
from dvc.repo import Repo
Repo.init(str(root), no_scm=True)
Repo(str(root)).site_cache_dir
modes = {}
for p in sorted(root.rglob("*")):
    if p.is_symlink() or ".dvc" in p.parts:
        continue
    modes[str(p.relative_to(root))] = stat.S_IMODE(p.lstat().st_mode)
print(json.dumps(modes))
"""


def stores(tmp_path, umask: int) -> dict[str, int]:
    env = clean_env(PYTHONPATH=str(ROOT), DVC_NO_ANALYTICS="1", HOME=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", MAKE_STORES, str(tmp_path / "proj"), oct(umask)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_databases_are_private_and_nothing_is_world_writable(tmp_path):
    """Under umask 000, the widest: the databases 0600 all the same, nothing world-writable."""
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "params.yaml").write_text("{}\n")
    modes = stores(tmp_path, 0o000)
    for db in ("work/mlflow/mlflow.db", "work/tune/s.db"):
        assert modes[db] == 0o600, (db, oct(modes[db]))
    writable = sorted(p for p, m in modes.items() if m & stat.S_IWOTH)
    assert writable == [], writable
    assert "work/dvc-site-cache/repo" in modes


def test_an_older_world_readable_store_is_narrowed(tmp_path):
    from enn_core.atomic import private_file

    db = tmp_path / "mlflow.db"
    db.write_bytes(b"")
    os.chmod(db, 0o644)
    (tmp_path / "mlflow.db-wal").write_bytes(b"")
    os.chmod(tmp_path / "mlflow.db-wal", 0o666)
    (tmp_path / "link.db").symlink_to(db)
    private_file(db)
    assert stat.S_IMODE(db.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "mlflow.db-wal").stat().st_mode) == 0o600
    assert (tmp_path / "link.db").is_symlink()


def test_a_link_planted_in_the_work_directory_is_never_written_through(tmp_path):
    """The pipeline lock was truncated through a link (whatever it pointed at, as root any
    file); the servers' logs appended to it; ui.json overwrote it."""
    from enn_core.errors import DataError
    from flows.console import LogFile
    from flows.servers import free_port, start_server
    from tasks.lock import pipeline_lock
    from tasks.ui import announce_ui

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    for name in ("pipeline.lock", "logs/prefect-api.log", "logs/run.log", "ui.json"):
        (work / name).symlink_to(victim)
    with pytest.raises(DataError, match=r"pipeline.lock is a link or not a plain file"):
        with pipeline_lock(work / "pipeline.lock", "test"):
            pass
    health = f"http://127.0.0.1:{free_port()}/health"
    with pytest.raises(DataError, match=r"prefect-api.log is a link"):
        start_server(["true"], {}, health, work / "logs" / "prefect-api.log")
    with pytest.raises(DataError, match=r"run.log is a link"):
        LogFile(work / "logs" / "run.log")
    announce_ui(work, "http://127.0.0.1:1/api", "http://127.0.0.1:2")
    assert not (work / "ui.json").is_symlink()  # replaced, not written through
    assert victim.read_text() == "precious"
