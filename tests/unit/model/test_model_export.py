"""The model exports with torch.export with a dynamic batch dimension."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim, export

from enn_core.config.model import ModelConfig
from enn_core.model import build_model
from tests.fixtures.model import make_features


class _Predict(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model.predict(x)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("preset", ["spatiotemporal", "tabular"])
def test_torch_export_dynamic_batch(manifest, preset):
    cfg = ModelConfig(
        preset=preset, d_model=16, heads=2, layers=1, embed_dim=4, conditioning="film+cross"
    )
    model = build_model(cfg, manifest).eval()
    ep = export(
        _Predict(model),
        (torch.from_numpy(make_features(4)),),
        dynamic_shapes={"x": {0: Dim("batch", min=1, max=4096)}},
    )
    for n in (1, 7):
        x = torch.from_numpy(make_features(n, seed=n))
        torch.testing.assert_close(ep.module()(x), model.predict(x), rtol=1e-5, atol=1e-4)
