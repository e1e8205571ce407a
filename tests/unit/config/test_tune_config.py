"""The tune: section: its search space parsed into records, bad entries one line naming
`tune.space.<key>`."""

from __future__ import annotations

import json

import pytest

from enn_core.config import ConfigError, load_config
from enn_core.config.tune import dimensions


def space(value: dict) -> str:
    return f"tune.space={json.dumps(value)}"


def test_space_parses_ranges_log_steps_and_choices():
    cfg = load_config(
        None,
        [
            space(
                {
                    "train.lr": {"low": 1e-4, "high": 0.1, "log": True},
                    "model.layers": {"low": 1, "high": 3},
                    "train.weight_decay": {"low": 0.0, "high": 0.1, "step": 0.05},
                    "model.d_model": {"choices": [16, 32]},
                }
            )
        ],
    )
    dims = {d.key: d for d in dimensions(cfg.tune)}
    assert dims["train.lr"].kind == "float" and dims["train.lr"].log
    assert dims["model.layers"].kind == "int"
    assert dims["train.weight_decay"].step == 0.05
    assert dims["model.d_model"].choices == (16, 32)


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        (
            {"train.lrr": {"low": 1, "high": 2}},
            "tune.space.train.lrr: unknown config key; did you mean 'train.lr'",
        ),
        (
            {"data.val_fraction": {"low": 0.1, "high": 0.2}},
            "tune.space.data.val_fraction: only model.* and train.*",
        ),
        (
            {"train.lr": {"low": 0.0, "high": 0.1, "log": True}},
            "tune.space.train.lr: a log scale needs low > 0",
        ),
        (
            {"train.lr": {"low": 0.1, "high": 0.01}},
            "tune.space.train.lr: low=0.1 must be below high=0.01",
        ),
        ({"train.lr": {"low": "a", "high": 0.1}}, "tune.space.train.lr.low must be a number"),
        ({"train.lr": {"lo": 0.1, "high": 0.2}}, "tune.space.train.lr: expected {low, high"),
        (
            {"model.d_model": {"choices": []}},
            "tune.space.model.d_model: choices must be a non-empty list",
        ),
    ],
)
def test_bad_space_is_one_line_naming_the_key(entry, says):
    with pytest.raises(ConfigError) as err:
        load_config(None, [space(entry)])
    assert says in str(err.value)
    assert "\n" not in str(err.value)


def test_enqueued_trial_names_space_keys_only():
    with pytest.raises(
        ConfigError, match=r"tune.enqueue\[0\]: train.epochs is not a tune.space key"
    ):
        load_config(
            None,
            [
                space({"train.lr": {"low": 0.001, "high": 0.1}}),
                'tune.enqueue=[{"train.epochs": 3}]',
            ],
        )


def test_the_shipped_params_declare_a_valid_study():
    from tests.fixtures.project import ROOT

    cfg = load_config(ROOT / "params.yaml")
    assert {d.key for d in dimensions(cfg.tune)} >= {"train.lr"}
