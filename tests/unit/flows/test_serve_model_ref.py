"""`enn serve --model` takes a registered model: a file path, or a name the store does not
hold, is one line that says what it takes and which names the store has (a walk-through got
MLflow's "failures occurred while downloading" and "train first" for a typo)."""

from __future__ import annotations

import pytest

from enn_core.errors import ConfigError
from flows.serve import input_example


def test_a_file_path_is_one_line_saying_what_serve_takes(tmp_path):
    with pytest.raises(ConfigError, match=r"serves a registered model, models:/NAME@ALIAS"):
        input_example(str(tmp_path / "model.pt"), f"sqlite:///{tmp_path / 'mlflow.db'}")


def test_a_name_the_store_does_not_hold_lists_the_names_it_holds(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).create_registered_model("enn-synthetic")
    with pytest.raises(ConfigError, match=r"registered here: enn-synthetic \(docs/serving.md\)"):
        input_example("models:/enn-sinthetic@champion", uri)
