"""build_model: shapes, encodings, normalization in the model, validation, export."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from enn_core.config.model import ModelConfig
from enn_core.errors import ConfigError, DataError
from enn_core.model import SpatioTemporalENN, TabularENN, build_model
from tests.fixtures.model import make_features, make_manifest


@pytest.mark.parametrize("conditioning", ["film", "cross", "film+cross"])
def test_spatiotemporal_shapes_and_units(manifest, conditioning):
    cfg = ModelConfig(d_model=16, heads=2, layers=2, embed_dim=4, conditioning=conditioning)
    model = build_model(cfg, manifest).eval()
    assert isinstance(model, SpatioTemporalENN) and len(model.blocks) == 2
    x = torch.from_numpy(make_features(6))
    y = model(x)
    assert y.shape == (6, 5, 4) and y.dtype == torch.float32
    torch.testing.assert_close(model.predict(x), y * 15.0 + 80.0)
    # Different samples get different outputs (the features reach the grid).
    assert (y[0] - y[1]).abs().max() > 1e-4


def test_tabular_any_label_shape(tiny_cfg):
    for shape in ([7], [3, 4], [2, 3, 2]):
        cfg = ModelConfig(preset="tabular", d_model=16, heads=2, layers=1, embed_dim=4)
        model = build_model(cfg, make_manifest(label_shape=shape))
        assert isinstance(model, TabularENN)
        assert model(torch.from_numpy(make_features(3))).shape == (3, *shape)


def test_same_seed_same_weights_and_global_rng_untouched(manifest, tiny_cfg):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(tiny_cfg, manifest)
    assert torch.equal(torch.rand(1), before)  # build_model does not consume the global RNG
    b = build_model(tiny_cfg, manifest)
    c = build_model(ModelConfig(d_model=16, heads=2, layers=2, embed_dim=4, init_seed=1), manifest)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(va, vb), k
    assert any(
        not torch.equal(va, vc)
        for va, vc in zip(a.state_dict().values(), c.state_dict().values(), strict=True)
    )


def test_encoding_zscore_cyclic_and_unknown_codes(manifest, tiny_cfg):
    model = build_model(tiny_cfg, manifest)
    enc = model.encoder
    x = torch.tensor([[3.0, 1.0, 0.0, 20.0], [15.0, 1.0, 0.0, 12.0], [-1.0, 1.0, 0.0, 12.0]])
    e = enc(x)
    # continuous z-score first, then 3 embeddings of 4, then sin/cos of the month code.
    assert e.shape == (3, 1 + 3 * 4 + 2)
    assert e[0, 0].item() == pytest.approx((20.0 - 12.0) / 4.0)
    assert e[0, -2].item() == pytest.approx(np.sin(2 * np.pi * 3 / 12), abs=1e-6)
    assert e[0, -1].item() == pytest.approx(np.cos(2 * np.pi * 3 / 12), abs=1e-6)
    # Codes 15 and -1 are outside the 12-value vocabulary: both use the "unknown" row.
    unknown = enc.embeddings[0].weight[12]
    torch.testing.assert_close(e[1, 1:5], unknown)
    torch.testing.assert_close(e[2, 1:5], unknown)


def test_float64_features_keep_precision(tiny_cfg):
    m = make_manifest()
    m["feature_specs"][3] = {"name": "t", "kind": "continuous", "mean": 1.7e9, "std": 10.0}
    model = build_model(tiny_cfg, m)
    x = torch.tensor([[1.0, 1.0, 0.0, 1.7e9 + 25.0]], dtype=torch.float64)
    assert model.encoder(x)[0, 0].item() == pytest.approx(2.5)


def test_tiny_std_floored(tiny_cfg):
    m = make_manifest()
    m["label_stats"] = {"mean": 50.0, "std": 0.0}
    m["feature_specs"][3]["std"] = 0.0
    model = build_model(tiny_cfg, m)
    assert torch.all(model.label_std > 0) and torch.all(model.encoder.cont_std > 0)
    assert torch.isfinite(model.predict(torch.from_numpy(make_features(2)))).all()


def test_per_cell_label_stats(tiny_cfg, tmp_path):
    m = make_manifest()
    cell = np.arange(20, dtype=np.float32).reshape(5, 4)
    np.save(tmp_path / "cell_mean.npy", cell)
    m["label_stats"] = {"mean": 0.0, "std": [1.0] * 4, "cell_mean_file": "cell_mean.npy"}
    model = build_model(tiny_cfg, m, data_dir=tmp_path)
    torch.testing.assert_close(model.label_mean, torch.from_numpy(cell))
    with pytest.raises(DataError, match="data_dir"):
        build_model(tiny_cfg, m)


def test_config_validation_names_the_fix(manifest):
    with pytest.raises(ConfigError, match="pick heads in"):
        ModelConfig(d_model=10, heads=4)
    with pytest.raises(ConfigError, match="model.preset=tabular"):
        build_model(ModelConfig(d_model=16, heads=2), make_manifest(label_shape=[7]))
    bad = make_manifest()
    bad["feature_specs"][0]["kind"] = "text"
    with pytest.raises(DataError, match=r"feature_specs\[0\]"):
        build_model(ModelConfig(d_model=16, heads=2), bad)


def test_backward_reaches_every_parameter(manifest):
    cfg = ModelConfig(d_model=16, heads=2, layers=2, embed_dim=4, conditioning="film+cross")
    model = build_model(cfg, manifest)
    x = torch.from_numpy(make_features(4))
    model(x).pow(2).mean().backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    # Unknown-code rows of the embeddings are legitimately untouched; nothing else is.
    assert no_grad == []


def test_head_runs_fp32_under_bf16_autocast(manifest, tiny_cfg):
    model = build_model(tiny_cfg, manifest)
    x = torch.from_numpy(make_features(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    assert y.dtype == torch.float32


def test_describe(manifest, tiny_cfg):
    d = build_model(tiny_cfg, manifest).describe()
    assert d["preset"] == "spatiotemporal" and d["layers"] == 2 and d["parameters"] > 0
    assert d["features"]["categorical"] == {"month": 12, "daytype": 7, "direction": 2}
    assert d["features"]["cyclic"] == {"month": 12.0}


def test_cyclic_kind_uses_offset(tiny_cfg):
    m = make_manifest()
    m["feature_specs"][3] = {
        "name": "hour",
        "kind": "cyclic",
        "cyclic_period": 24,
        "cyclic_offset": 1,
    }
    enc = build_model(tiny_cfg, m).encoder
    e = enc(torch.tensor([[0.0, 0.0, 0.0, 7.0]]))
    # sin/cos of month code 0 then of hour (7 - 1) / 24.
    assert e[0, -2].item() == pytest.approx(np.sin(2 * np.pi * 6 / 24), abs=1e-6)
    assert e[0, -1].item() == pytest.approx(np.cos(2 * np.pi * 6 / 24), abs=1e-6)


def test_feature_dropout_training_only(manifest):
    cfg = ModelConfig(d_model=16, heads=2, layers=1, embed_dim=4, feature_dropout=0.9)
    model = build_model(cfg, manifest)
    with torch.no_grad():
        for emb in model.encoder.embeddings:
            emb.weight.fill_(1.0)
    x = torch.from_numpy(make_features(64))
    model.train()
    torch.manual_seed(0)
    e = model.encoder(x)
    assert (e == 0).float().mean() > 0.7  # most features dropped to their zero encoding
    model.eval()
    full = model.encoder(x)
    assert (full[:, 1:13] == 1.0).all() and torch.equal(full, model.encoder(x))
    with pytest.raises(ConfigError, match="feature_dropout"):
        ModelConfig(feature_dropout=1.0)


def test_without_cyclic_embeddings_the_month_is_its_sin_and_cos_only(manifest):
    """model.cyclic_embeddings=false: no embedding for the month (categorical and cyclic), so
    a month no training row had lies between its neighbours."""
    cfg = ModelConfig(preset="spatiotemporal", d_model=16, heads=2, embed_dim=4)
    both = build_model(cfg, manifest).encoder
    only = build_model(ModelConfig(**{**cfg.__dict__, "cyclic_embeddings": False}), manifest)
    enc = only.encoder
    assert both.layout.categorical == (0, 1, 2) and enc.layout.categorical == (1, 2)
    assert enc.out_dim == both.out_dim - 4 and len(enc.embeddings) == 2
    x = torch.from_numpy(make_features(3))

    def at(month: float) -> torch.Tensor:
        rows = x.clone()
        rows[:, 0] = month
        return enc(rows)

    may, june, july = at(4.0), at(5.0), at(6.0)
    torch.testing.assert_close(may[:, :-2], july[:, :-2])  # the month is only its sin/cos
    assert (june - may).abs().max() < (july - may).abs().max()  # June lies nearer May
    assert only(x).shape == (3, 5, 4)


def test_cyclic_basis_encodes_a_month_as_bumps_that_blend_its_neighbours(manifest):
    """model.cyclic_basis=K: K von Mises bumps round the cycle instead of sin/cos; a month
    between two centres is encoded as a blend of theirs (what a held-out month needs), the
    width in months sets how far a bump reaches, and feature dropout zeroes the whole block."""
    cfg = ModelConfig(
        d_model=16, heads=2, embed_dim=4, cyclic_basis=6, cyclic_width=1.5, feature_dropout=0.5
    )
    model = build_model(cfg, manifest)
    enc = model.encoder.eval()
    harmonic = build_model(ModelConfig(d_model=16, heads=2, embed_dim=4), manifest).encoder
    assert enc.out_dim == harmonic.out_dim - 2 + 6
    x = torch.from_numpy(make_features(3))

    def bumps(month: float) -> torch.Tensor:
        rows = x.clone()
        rows[:, 0] = month
        return enc(rows)[:, -6:]

    jan, feb, mar = bumps(0.0), bumps(1.0), bumps(2.0)  # centres at months 0, 2, 4, ...
    torch.testing.assert_close(jan[:, 0], torch.ones(3))
    torch.testing.assert_close(feb[:, 0], feb[:, 1])  # halfway between the first two centres
    assert 0.7 < float(feb[0, 0]) < 0.9  # exp(-1 / (2 * 1.5^2)) = 0.80 for a Gaussian
    torch.testing.assert_close(bumps(12.0), jan)  # round the cycle
    assert float(mar[0, 0]) < float(feb[0, 0]) < float(jan[0, 0])
    assert model(x).shape == (3, 5, 4)
    enc.train()
    torch.manual_seed(0)
    dropped = enc(torch.from_numpy(make_features(64)).repeat(4, 1))[:, -6:]
    assert ((dropped == 0).all(1) | (dropped > 0).all(1)).all()  # all bumps or none
    assert (dropped == 0).all(1).any()
    with pytest.raises(ConfigError, match="cyclic_width"):
        ModelConfig(cyclic_basis=6, cyclic_width=0.0)
