"""Config: merge order, unknown keys, validation messages, safe YAML, fault refusal."""

from __future__ import annotations

import pytest

from enn_core.config import load_config
from enn_core.errors import ConfigError


def write(tmp_path, text: str):
    p = tmp_path / "params.yaml"
    p.write_text(text)
    return p


def test_defaults_then_file_then_overrides(tmp_path):
    p = write(tmp_path, "train:\n  epochs: 7\n  lr: 0.01\n")
    assert load_config(None).train.epochs == 20
    cfg = load_config(p, ["train.epochs=3"])
    assert cfg.train.epochs == 3  # override beats file
    assert cfg.train.lr == 0.01  # file beats default
    assert cfg.model.d_model == load_config(None).model.d_model  # default kept


def test_typo_names_the_closest_key(tmp_path):
    p = write(tmp_path, "{}\n")
    with pytest.raises(
        ConfigError, match=r"unknown config key 'train.epoch'; did you mean 'train.epochs'"
    ):
        load_config(p, ["train.epoch=3"])
    p = write(tmp_path, "trian:\n  epochs: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'train'"):
        load_config(p)


def test_validation_names_field_and_fix(tmp_path):
    with pytest.raises(
        ConfigError, match=r"heads=3 does not divide model.d_model=64; pick heads in"
    ):
        load_config(None, ["model.heads=3"])
    with pytest.raises(ConfigError, match="train.epochs must be an integer"):
        load_config(None, ["train.epochs=three"])
    with pytest.raises(ConfigError, match="not one of"):
        load_config(None, ["train.loss=l2"])
    with pytest.raises(ConfigError, match=r"train.quantile=1.5 must be in \(0, 1\)"):
        load_config(None, ["train.loss=quantile", "train.quantile=1.5"])


def test_yaml_is_safe_loaded(tmp_path):
    p = write(tmp_path, "train: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


def test_missing_file_and_bad_override_format(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["train.epochs"])


def test_fault_section_refused_outside_tests(monkeypatch):
    monkeypatch.delenv("ENN_ALLOW_FAULTS", raising=False)
    with pytest.raises(ConfigError, match="tests only"):
        load_config(None, ["fault.kind=raise", "fault.phase=stage-data"])
    cfg = load_config(None, ["fault.kind=raise", "fault.phase=stage-data"], allow_faults=True)
    assert cfg.fault.kind == "raise"


def test_configs_are_frozen():
    cfg = load_config(None)
    with pytest.raises(AttributeError):
        cfg.train.epochs = 5  # type: ignore[misc]


def test_params_files_load():
    """The repo's params.yaml and prediction/params.yaml are valid configs."""
    from enn_core.paths import find_root

    root = find_root(__file__)
    load_config(root / "params.yaml")
    load_config(root / "prediction" / "params.yaml")


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_a_non_finite_number_is_refused_before_params_yaml_is_written(tmp_path, value):
    from flows.params_file import apply_overrides

    params = tmp_path / "params.yaml"
    params.write_text("train:\n  lr: 0.01\n")
    before = params.read_bytes()
    with pytest.raises(ConfigError, match=r"train.lr must be a finite number"):
        apply_overrides(params, [f"train.lr={value}"])
    assert params.read_bytes() == before


def test_a_table_without_a_cyclic_column_needs_only_an_empty_data_cyclic(tmp_path):
    """Issue 54: `data.cyclic=[]` alone failed on the default cyclic_starts=[1] (and, with the
    project's params.yaml, cyclic_periods=[12]): three keys for a table with no cyclic column."""
    p = tmp_path / "params.yaml"
    p.write_text("data:\n  cyclic: [month]\n  cyclic_periods: [12]\n  cyclic_starts: [1]\n")
    for path in (None, p):
        data = load_config(path, ["data.cyclic=[]"]).data
        assert data.cyclic == data.cyclic_periods == data.cyclic_starts == ()
    # a cyclic key still needs its period and start, one each
    with pytest.raises(ConfigError, match="data.cyclic_starts"):
        load_config(p, ["data.cyclic=[month, hour]", "data.cyclic_periods=[12, 24]"])
