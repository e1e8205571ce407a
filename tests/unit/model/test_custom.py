"""Your own nn.Module (`model.preset: custom`): built by the factory the params name, saved and
loaded like the presets, and never imported because a checkpoint names it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from enn_core.checkpoint import load_model, read_checkpoint, save_consolidated
from enn_core.config import RunConfig
from enn_core.config.loader import build, deep_merge
from enn_core.config.model import ModelConfig
from enn_core.errors import ConfigError, StaleOutputError
from enn_core.model import CustomENN, ModelCode, build_model
from enn_core.model_code import check_dvc_deps
from tests.fixtures.model import make_features, make_manifest

ROOT = Path(__file__).resolve().parents[3]  # the repository: examples/ is importable from it
TCN = "examples.tcn.model:build"


def _cfg(**model) -> ModelConfig:
    data = {"preset": "custom", "factory": TCN, "options": {"channels": 8}, **model}
    return build(ModelConfig, data, root=ModelConfig, where="params.yaml")


def test_the_example_builds_trains_a_step_and_predicts_the_label_shape():
    cfg = _cfg()
    model = build_model(cfg, make_manifest(), code=ModelCode.of(cfg, ROOT))
    assert isinstance(model, CustomENN) and len(model.blocks) == 2  # two FSDP units
    x = torch.from_numpy(make_features(6))
    out = model(x)
    assert out.shape == (6, 5, 4) and out.dtype == torch.float32
    out.pow(2).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert model.predict(x).shape == (6, 5, 4)
    info = model.describe()
    assert info["factory"] == TCN and info["options"] == {"channels": 8}
    assert info["fsdp_units"] == 2


def test_a_checkpoint_records_factory_and_options_and_loads_only_with_the_same_factory(
    tmp_path,
):
    cfg = _cfg()
    code = ModelCode.of(cfg, ROOT)
    model = build_model(cfg, make_manifest(), code=code).eval()
    path = save_consolidated(tmp_path / "model.pt", model, cfg, make_manifest())
    stored = read_checkpoint(path).model_config  # weights_only=True: JSON types only
    assert stored["factory"] == TCN and stored["options"] == {"channels": 8}
    loaded, _ = load_model(path, code)
    x = torch.from_numpy(make_features(3))
    torch.testing.assert_close(loaded(x), model(x))
    for other in (ModelCode(), ModelCode("examples.tcn.other:build", str(ROOT))):
        with pytest.raises(StaleOutputError) as e:
            load_model(path, other)
        msg = str(e.value)
        assert "\n" not in msg and f"built by model.factory {TCN!r}" in msg
        assert "never chooses what code runs" in msg


def test_a_checkpoint_naming_other_code_never_imports_it(tmp_path):
    """A crafted checkpoint whose factory's module would run code on import is refused before
    anything is imported."""
    evil = tmp_path / "evil"
    evil.mkdir()
    marker = tmp_path / "MARKER"
    (evil / "mod.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef build(spec): ...\n")
    cfg = _cfg()
    model = build_model(cfg, make_manifest(), code=ModelCode.of(cfg, ROOT))
    crafted = ModelConfig(preset="custom", factory="evil.mod:build")
    path = save_consolidated(tmp_path / "model.pt", model, crafted, make_manifest())
    with pytest.raises(StaleOutputError, match="built by model.factory 'evil.mod:build'"):
        load_model(path, ModelCode(TCN, str(tmp_path)))
    assert not marker.exists()


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"factory": ""}, "model.preset=custom needs model.factory"),
        ({"factory": "examples/tcn.py"}, "is not 'package.module:function'"),
        ({"options": {"x": float("inf")}}, "model.options.x=inf is not finite"),
    ],
)
def test_bad_custom_config_is_one_line(model, message):
    with pytest.raises(ConfigError, match=message) as e:
        _cfg(**model)
    assert "\n" not in str(e.value)


def test_going_back_to_a_preset_needs_only_the_preset(tmp_path):
    """Issue 32: after your own model, `--set model.preset=spatiotemporal` was refused until
    model.options and model.factory were cleared by hand. A built-in preset ignores the options
    (none reach its config, fingerprint or checkpoint); the factory stays as the params say."""
    from enn_core.config import load_config
    from enn_core.train.fingerprint import fingerprint

    params = tmp_path / "params.yaml"
    params.write_text(
        f"model:\n  preset: custom\n  factory: {TCN}\n  options: {{channels: 32, layers: 2}}\n"
    )
    back = load_config(params, ["model.preset=spatiotemporal"])
    assert back.model.preset == "spatiotemporal" and dict(back.model.options) == {}
    assert back.model.factory == TCN
    plain = load_config(None, ["model.preset=spatiotemporal", f"model.factory={TCN}"])
    assert fingerprint(back, "data").digest == fingerprint(plain, "data").digest
    model = build_model(back.model, make_manifest(), code=ModelCode.of(back.model, ROOT))
    path = save_consolidated(tmp_path / "init.pt", model, back.model, make_manifest())
    assert read_checkpoint(path).model_config["options"] == {}
    assert type(load_model(path, ModelCode.of(back.model, ROOT))[0]) is type(model)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"factory": "examples.nothing:build"}, "no examples/nothing.py under the project root"),
        ({"factory": "examples.tcn.model:nothing"}, "has no function 'nothing'"),
        ({"options": {"kernel": 2}}, "ValueError: kernel=2 must be odd"),
        ({"options": {"width": 2}}, "TypeError: build() got an unexpected keyword"),
    ],
)
def test_a_factory_that_cannot_build_is_one_line(model, message):
    cfg = _cfg(**model)
    with pytest.raises(ConfigError) as e:
        build_model(cfg, make_manifest(), code=ModelCode.of(cfg, ROOT))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_output_of_another_shape_is_one_line(tmp_path):
    (tmp_path / "flat.py").write_text(
        "import torch\ndef build(spec):\n    return torch.nn.Linear(spec.encoded_dim, 3)\n"
    )
    cfg = _cfg(factory="flat:build", options={})
    with pytest.raises(ConfigError, match=r"maps \[2, \d+\] to \[2, 3\], not \[2, 5, 4\]"):
        build_model(cfg, make_manifest(), code=ModelCode.of(cfg, tmp_path))


def test_options_take_set_keys():
    data: dict = {}
    deep_merge(data, "model.preset", "custom", RunConfig)
    deep_merge(data, "model.factory", TCN, RunConfig)
    deep_merge(data, "model.options.channels", 16, RunConfig)
    cfg = build(RunConfig, data, root=RunConfig, where="--set")
    assert dict(cfg.model.options) == {"channels": 16} and hash(cfg.model)


def test_dvc_must_know_the_models_code(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "net.py").write_text("def build(spec): ...\n")
    dvc = tmp_path / "dvc.yaml"
    both = ["prepare_checkpoint", "distributed_train"]
    stage = "  {}:\n    cmd: x\n    deps:\n      - {}\n"
    dvc.write_text("stages:\n" + stage.format(both[0], "enn_core") + stage.format(both[1], "x"))
    with pytest.raises(ConfigError) as e:  # every stage that lacks it, in one line
        check_dvc_deps("models.net:build", tmp_path, dvc, both)
    assert "stages prepare_checkpoint, distributed_train do not depend on models/net" in str(
        e.value
    )
    assert "add '- models/net.py' under the deps of each" in str(e.value)
    dvc.write_text("stages:\n" + stage.format(both[0], "models") + stage.format(both[1], "x"))
    with pytest.raises(ConfigError, match=r"stage distributed_train does not depend on models"):
        check_dvc_deps("models.net:build", tmp_path, dvc, both)
    for dep in ("models", "models/net.py"):
        dvc.write_text("stages:\n" + stage.format(both[0], dep) + stage.format(both[1], dep))
        check_dvc_deps("models.net:build", tmp_path, dvc, both)


RAW = """
import torch


class Raw(torch.nn.Module):
    raw_features = True  # the raw feature row, categorical values as vocabulary codes

    def __init__(self, spec):
        super().__init__()
        self.shape = spec.label_shape
        self.seen = None
        self.head = torch.nn.Linear(len(spec.features), spec.label_shape[0] * spec.label_shape[1])

    def forward(self, x):
        self.seen = x
        return self.head(x).reshape(x.shape[0], *self.shape)


def build(spec):
    return Raw(spec)
"""


def test_a_module_that_declares_raw_features_gets_the_raw_rows(tmp_path):
    (tmp_path / "raw.py").write_text(RAW)
    cfg = _cfg(factory="raw:build", options={})
    model = build_model(cfg, make_manifest(), code=ModelCode.of(cfg, tmp_path))
    x = torch.from_numpy(make_features(5))
    assert model(x).shape == (5, 5, 4)
    torch.testing.assert_close(model.body.seen, x)  # not the encoding: the row as staged
    assert model.describe()["fsdp_units"] == 0  # no `blocks`: the whole model is one unit


TWISTED = """
import torch


@torch.library.custom_op("enncustom::twist", mutates_args=())
def twist(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twist.register_fake
def _(x):
    return torch.empty_like(x)


class Twisted(torch.nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.shape = spec.label_shape
        self.head = torch.nn.Linear(spec.encoded_dim, spec.label_shape[0] * spec.label_shape[1])

    def forward(self, x):
        return twist(self.head(x)).reshape(x.shape[0], *self.shape)


def build(spec):
    return Twisted(spec)
"""


@pytest.mark.slow
def test_a_module_that_cannot_export_gets_the_one_line_naming_its_operator(tmp_path):
    from enn_core import export as export_mod
    from enn_core.config import ExportConfig
    from enn_core.errors import ExportError
    from enn_core.inference import Calibration, PredictionPath

    (tmp_path / "code" / "twisted").mkdir(parents=True)
    (tmp_path / "code" / "twisted" / "__init__.py").write_text(TWISTED)
    cfg = _cfg(factory="twisted:build", options={})
    model = build_model(cfg, make_manifest(), code=ModelCode.of(cfg, tmp_path / "code")).eval()
    out = tmp_path / "export"
    out.mkdir()
    with pytest.raises(ExportError) as e:
        export_mod.export_all(
            PredictionPath(model, Calibration()), make_features(16), out, ExportConfig(), 15.0
        )
    msg = str(e.value)
    assert msg.startswith("export onnx: operator enncustom.twist.default has no ONNX"), msg
    assert "\n" not in msg


SPY = """
SEEN = []


def build(spec):
    import torch

    SEEN.append(spec)
    return torch.nn.Sequential(
        torch.nn.Linear(spec.encoded_dim, 20), torch.nn.Unflatten(1, tuple(spec.label_shape))
    )
"""


def test_the_factory_is_told_the_features_with_their_vocabularies_and_the_labels(tmp_path):
    (tmp_path / "spy.py").write_text(SPY)
    cfg = _cfg(factory="spy:build", options={})
    build_model(cfg, make_manifest(), code=ModelCode.of(cfg, tmp_path))
    spec = sys.modules["spy"].SEEN[-1]  # the module the factory was imported from
    by_name = {f.name: f for f in spec.features}
    assert by_name["direction"].kind == "categorical"
    assert by_name["direction"].vocabulary == ("up", "down")
    assert by_name["direction"].vocab_size == 2
    assert by_name["month"].vocabulary[0] == "01" and len(by_name["month"].vocabulary) == 12
    assert by_name["temp"].kind == "continuous" and by_name["temp"].vocabulary == ()
    assert spec.label_shape == (5, 4) and spec.label_axes == ("section", "hour")
    assert spec.label_axis_values["section"] == [f"s{i}" for i in range(5)]
