"""MLflow parent run names say what differs from the pipeline's params file (issue 39): a run
with --set train.epochs=3 after a run with another config was named "training #3 synthetic
data.source=synthetic data.path=... (+19)", diffed against whichever run came before."""

from __future__ import annotations

from pathlib import Path

from enn_core.config import load_config
from enn_core.paths import Layout
from flows.params_file import mlflow_tags, plan


def test_a_run_is_named_for_its_own_changes_not_the_previous_run(tmp_path):
    from tasks.tracking import Tracker

    root = tmp_path / "proj"
    (root / ".dvc").mkdir(parents=True)
    (root / "dvc.yaml").write_text("stages: {}\n")
    (root / "params.yaml").write_text("train:\n  epochs: 25\n")
    (root / "configs").mkdir()
    overlay = root / "configs" / "expressway.yaml"
    overlay.write_text("train:\n  epochs: 25\n  lr: 0.02\nmodel:\n  d_model: 64\n")
    layout = Layout.for_root(root)
    uri = f"tracking.uri=sqlite:///{layout.mlflow_dir / 'mlflow.db'}"
    names = []
    for config, sets in (
        (overlay, ["data.test_fold=1"]),  # another config first, with many other values
        (root / "params.yaml", ["train.epochs=3"]),
        (root / "params.yaml", []),
    ):
        cfg = load_config(config, [uri, *sets])
        tracker = Tracker(cfg, layout)
        tags = mlflow_tags(plan(Path(config), sets))
        run_id = tracker.start_parent("training", tags, cfg=cfg, data="synthetic")
        tracker.end(run_id)
        names.append(tracker.client.get_run(run_id).info.run_name)
    assert names == [
        "training #1 synthetic expressway.yaml data.test_fold=1",
        "training #2 synthetic train.epochs=3",
        "training #3 synthetic",
    ], names
