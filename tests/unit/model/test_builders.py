"""What build_model builds from: presets come from one registry (enn_core.model.enn.BUILDERS),
and a preset that ModelConfig accepts without a builder stops the import, never building
another preset; the data side is the staged manifest, its data spec or their JSON form, alike."""

from __future__ import annotations

import subprocess
import sys
import typing

import torch

from enn_core.config.model import ModelConfig, Preset
from enn_core.data.dataset import StagedDataset
from enn_core.model import BUILDERS, SpatioTemporalENN, TabularENN, build_model
from tests.fixtures import train
from tests.fixtures.model import make_manifest
from tests.fixtures.project import ROOT


def test_every_preset_the_config_accepts_has_its_builder():
    assert set(BUILDERS) == set(typing.get_args(Preset))
    cfg = ModelConfig(d_model=16, heads=2, layers=1, embed_dim=4)
    for preset, cls in (("tabular", TabularENN), ("spatiotemporal", SpatioTemporalENN)):
        model = build_model(ModelConfig(**{**cfg.__dict__, "preset": preset}), make_manifest())
        assert type(model) is cls and model.preset == preset


def test_a_preset_without_a_builder_fails_at_import():
    code = (
        "import typing, enn_core.config.model as m\n"
        "m.Preset = typing.Literal['spatiotemporal', 'tabular', 'custom', 'graph']\n"
        "import enn_core.model\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: model presets of ModelConfig.preset")
    assert "'graph'" in last and "add the builder to BUILDERS" in last


def test_the_manifest_its_data_spec_and_their_json_build_one_model(tmp_path):
    cfg = train.tiny_cfg("model.prior_weight=0.5")
    staged = train.staged_dir(tmp_path, cfg)
    manifest = StagedDataset(staged).manifest
    forms = (manifest, manifest.data_spec(), manifest.model_data())
    models = [build_model(cfg.model, m, data_dir=staged) for m in forms]
    assert models[0].prior is not None and models[0].prior.n_rows > 0
    for other in models[1:]:
        assert other.state_dict().keys() == models[0].state_dict().keys()
        for name, value in models[0].state_dict().items():
            assert torch.equal(other.state_dict()[name], value), name
