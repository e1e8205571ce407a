"""The pipeline's MLflow parent run shows what this run made: a run that fails before its
stage-data finished is not logged with the previous run's input dataset (issue 32)."""

from __future__ import annotations

import pytest

from enn_core.config import load_config
from enn_core.errors import DataError
from enn_core.paths import Layout
from enn_core.stages import STAGE_DATA
from tests.fixtures.project import tiny_overrides


def test_a_failed_run_is_not_logged_with_the_previous_runs_dataset(tmp_path):
    from mlflow.tracking import MlflowClient

    from tasks.runner import execute_stage
    from tasks.session import pipeline_session

    (tmp_path / "params.yaml").write_text("{}\n")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(None, [*tiny_overrides(), f"tracking.uri={uri}"])
    layout = Layout.for_root(tmp_path)
    config = tmp_path / "params.yaml"
    specs = (STAGE_DATA,)
    with pipeline_session(cfg, config, layout, "prediction", specs=specs) as first:
        execute_stage(STAGE_DATA, first)
    with (
        pytest.raises(DataError),
        pipeline_session(cfg, config, layout, "prediction", specs=specs) as second,
    ):
        raise DataError("new.csv: row 2: category 'someday' was not seen in training")
    client = MlflowClient(tracking_uri=uri)
    ok, failed = client.get_run(first.parent_id), client.get_run(second.parent_id)
    assert ok.info.status == "FINISHED" and failed.info.status == "FAILED"
    assert [d.dataset.name for d in ok.inputs.dataset_inputs] == ["synthetic"]
    assert failed.inputs.dataset_inputs == [], "the failed run shows the previous run's input"
