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


def test_a_dvc_exp_run_is_named_for_what_differs_from_the_committed_params_file(tmp_path):
    """`dvc exp run -S train.lr=0.005` gives enn no --set: the name says what the file holds
    against its last commit."""
    import subprocess

    from flows.params_file import TAG_CHANGES_KEY

    root = tmp_path / "proj"
    (root / ".dvc").mkdir(parents=True)
    (root / "dvc.yaml").write_text("stages: {}\n")
    params = root / "params.yaml"
    params.write_text("train:\n  epochs: 25\n  lr: 0.01\nruntime:\n  seed: 0\n")
    git = ["git", "-C", str(root), "-c", "user.email=t@e.invalid", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "params"], check=True)
    params.write_text("train:\n  epochs: 25\n  lr: 0.005\nruntime:\n  seed: 3\n")  # as DVC -S
    tags = mlflow_tags(plan(params, []))
    assert tags[TAG_CHANGES_KEY] == '["train.lr=0.005"]', tags  # runtime: how to run, not what


def test_the_tag_names_agree():
    from flows.params_file import TAG_CHANGES_KEY
    from tasks.tracking.runs import TAG_CHANGES

    assert TAG_CHANGES_KEY == TAG_CHANGES


def test_the_number_follows_the_newest_parents_and_a_store_made_before_it_is_counted(tmp_path):
    """The run number is one more than the highest `enn.number` among the newest parents,
    never found by loading every run; a store whose runs have no number counts them once; a
    tag that is not a small number (anyone with the store can write one) is not a number."""
    from tasks.tracking import Tracker
    from tasks.tracking.runs import TAG_NUMBER

    layout = Layout.for_root(tmp_path)
    cfg = load_config(None, [f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    tracker = Tracker(cfg, layout)

    def start() -> str:
        run_id = tracker.start_parent("training", {}, cfg=cfg, data="synthetic")
        tracker.end(run_id)
        return run_id

    def name(run_id: str) -> str:
        return tracker.client.get_run(run_id).info.run_name

    first = start()
    assert name(first) == "training #1 synthetic"
    assert tracker.client.get_run(first).data.tags[TAG_NUMBER] == "1"
    tracker.client.delete_tag(first, TAG_NUMBER)  # as a store written before the tag
    second = start()
    assert name(second) == "training #2 synthetic"  # counted
    tracker.client.set_tag(second, TAG_NUMBER, "41")  # the number, not the count, is followed
    third = start()
    assert name(third) == "training #42 synthetic"
    fourth = start()
    assert name(fourth) == "training #43 synthetic"
    # the newest parent (by start time) holding a lower number, as one started on a node whose
    # clock is behind: the highest is followed, not the newest
    tracker.client.set_tag(fourth, TAG_NUMBER, "7")
    assert name(start()) == "training #43 synthetic"
    runs = tracker.client.search_runs([tracker.experiment_id], max_results=100)
    for run, hostile in zip(runs, ("²", "9" * 5000, "-4", "1e9", ""), strict=True):  # 5 runs
        tracker.client.set_tag(run.info.run_id, TAG_NUMBER, hostile)
    assert name(start()) == f"training #{len(runs) + 1} synthetic"  # none a number: counted
