"""A config's project root (enn_core/paths.py)."""

from __future__ import annotations

import pytest


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


@pytest.mark.parametrize("run_id", ["../../elsewhere", "/tmp/x", "a/b", "", ".."])
def test_a_run_id_from_the_environment_is_a_name_never_a_path(tmp_path, run_id):
    """TORCHELASTIC_RUN_ID names `work/runs/<id>-rank<r>/` under an external launcher."""
    from enn_core.errors import ConfigError
    from enn_core.paths import Layout

    layout = Layout.for_root(tmp_path)
    assert layout.run_dir("job-7_a.b", "predict") == tmp_path / "work/runs/job-7_a.b/predict"
    with pytest.raises(ConfigError, match="is not a name"):
        layout.run_dir(run_id, "predict")


def test_prediction_params_show_where_tracking_goes():
    """docs/scale-out.md says to set the tracking server in prediction/params.yaml "too"; the
    file had no tracking: section to set it in."""
    from pathlib import Path

    import yaml

    from enn_core.config import load_config

    path = Path(__file__).resolve().parents[2] / "prediction" / "params.yaml"
    raw = yaml.safe_load(path.read_text())
    assert set(raw["tracking"]) >= {"uri", "registered_model"}, raw.get("tracking")
    assert "tracking.uri in params.yaml" in path.read_text()
    assert load_config(path).tracking.uri == ""
