"""Model presets come from one registry (enn_core.model.enn.BUILDERS): a preset that
ModelConfig accepts without a builder stops the import, never building another preset."""

from __future__ import annotations

import subprocess
import sys
import typing

from enn_core.config.model import ModelConfig, Preset
from enn_core.model import BUILDERS, SpatioTemporalENN, TabularENN, build_model
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
