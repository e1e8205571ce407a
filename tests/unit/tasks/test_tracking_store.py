"""The MLflow store the tracker opens: a corrupt database is one line naming the file and fix;
a tracking server that does not answer is one line at once."""

from __future__ import annotations

import os

import pytest

from enn_core.config import load_config
from enn_core.errors import StoreError
from enn_core.paths import Layout


def test_a_corrupt_mlflow_database_names_the_file_and_the_fix(tmp_path):
    from tasks.tracking import Tracker

    (tmp_path / "params.yaml").write_text("{}\n")
    layout = Layout.for_root(tmp_path)
    layout.mlflow_dir.mkdir(parents=True)
    db = layout.mlflow_dir / "mlflow.db"
    db.write_bytes(os.urandom(4096))
    cfg = load_config(None, [f"tracking.uri=sqlite:///{db}"])
    with pytest.raises(StoreError) as e:
        Tracker(cfg, layout)
    msg = str(e.value)
    assert "\n" not in msg and e.value.exit_code == 10
    assert msg.startswith(f"{db}: the MLflow store cannot be read (")
    assert f"mv {db} {db}.broken" in msg


@pytest.mark.timeout(60)
def test_a_tracking_server_that_does_not_answer_is_one_line_at_once(tmp_path):
    """MLflow's client retries a refused connection seven times over about four minutes."""
    import time

    from flows.servers import free_port
    from tasks.tracking import Tracker

    (tmp_path / "params.yaml").write_text("{}\n")
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = load_config(None, [f"tracking.uri={uri}"])
    t0 = time.monotonic()
    with pytest.raises(StoreError) as e:
        Tracker(cfg, Layout.for_root(tmp_path))
    assert time.monotonic() - t0 < 30
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{uri}: the MLflow tracking store did not answer")


def test_an_experiment_another_host_made_first_is_joined(tmp_path, monkeypatch):
    """Two tasks of a job array open one tracking store at once: both find no experiment, one
    creates it, the other's create is refused as existing; that one joins it (CI run: a job
    array's task failed with RESOURCE_ALREADY_EXISTS)."""
    from mlflow.tracking import MlflowClient

    from tasks.tracking import Tracker

    (tmp_path / "params.yaml").write_text("{}\n")
    layout = Layout.for_root(tmp_path)
    layout.mlflow_dir.mkdir(parents=True)
    uri = f"sqlite:///{layout.mlflow_dir / 'mlflow.db'}"
    cfg = load_config(None, [f"tracking.uri={uri}", "tracking.experiment=raced"])
    first = Tracker(cfg, layout).experiment_id  # the other host, a moment earlier
    real = MlflowClient.get_experiment_by_name
    calls = []

    def not_yet(self, name):  # this host looked just before the other created it
        calls.append(name)
        return None if len(calls) == 1 else real(self, name)

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", not_yet)
    assert Tracker(cfg, layout).experiment_id == first
    assert calls == ["raced", "raced"]
