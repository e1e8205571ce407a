"""The config `enn run` preloads is reused by its flows only for the overrides it was loaded
with: a flow that adds one (the prediction flow's `--model PATH`) gets a config that has it."""

from __future__ import annotations

from enn_core.config import load_config
from flows.training import load_once, preloaded


def test_a_flow_that_adds_an_override_gets_it(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("{}\n")
    given = ["train.epochs=3"]
    cfg = load_config(params, given)
    with preloaded(params, given, cfg):
        assert load_once(params.resolve(), list(given)) is cfg
        more = load_once(params.resolve(), [*given, "predict.model=other/model.pt"])
        assert more.predict.model == "other/model.pt" and more.train.epochs == 3
    other = tmp_path / "prediction.yaml"
    other.write_text("{}\n")
    with preloaded(params, given, cfg):
        assert load_once(other.resolve(), given) is not cfg  # another file: loaded
