"""tracking.log_system_metrics: the pipeline's parent run gets MLflow's system/... metrics."""

from __future__ import annotations

import time

from enn_core.config import load_config
from enn_core.paths import Layout


def test_parent_run_gets_system_metrics_only_when_asked(tmp_path, monkeypatch):
    from tasks.tracking import Tracker

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")  # MLflow's 10 s
    (tmp_path / "params.yaml").write_text("{}\n")
    layout = Layout.for_root(tmp_path)
    uri = f"tracking.uri=sqlite:///{layout.mlflow_dir / 'mlflow.db'}"
    found = {}
    for on in (False, True):
        tracker = Tracker(load_config(None, [uri, f"tracking.log_system_metrics={on}"]), layout)
        run_id = tracker.start_parent("training", {})
        assert run_id is not None and tracker.client is not None
        time.sleep(1.5)
        tracker.end(run_id)
        metrics = tracker.client.get_run(run_id).data.metrics
        found[on] = {k for k in metrics if k.startswith("system/")}
    assert found[False] == set()
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= found[
        True
    ]
