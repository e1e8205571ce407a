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


def test_a_stepped_float_runs_on_its_grid_from_low():
    """Rounding to the step's decimals alone put 0.15 (low 0.05, step 0.1) at 0.1 or 0.2 and
    0.65 (low 0.15, step 0.5) at 0.7: values off the grid Optuna samples."""
    from enn_core.config.tune import Dimension

    d = Dimension("train.lr", "float", 0.05, 1.0, step=0.1)
    assert [d.point(v) for v in (0.15000000000000002, 0.25, 0.35000000000000003)] == [
        0.15,
        0.25,
        0.35,
    ]
    d = Dimension("train.lr", "float", 0.15, 3.0, step=0.5)
    assert [d.point(v) for v in (0.65, 1.15, 2.1500000000000004)] == [0.65, 1.15, 2.15]
    assert Dimension("train.lr", "float", 0.0, 1.0, step=0.1).point(0.30000000000000004) == 0.3
