"""The neighbour prior (model.prior_weight): weights and statistics against a hand computation,
the rows it leaves out, the blend with the network, and the model that carries it through a
checkpoint, torch.export and ONNX without the data."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch.export import Dim, export

from enn_core.checkpoint import load_model, save_consolidated
from enn_core.config.model import ModelConfig
from enn_core.data.dataset import StagedDataset
from enn_core.errors import ConfigError
from enn_core.model import build_model
from enn_core.model.encoding import FeatureLayout
from enn_core.model.prior import NeighbourPrior

# month (categorical with a 12-month cycle), day type (categorical), one continuous feature
LAYOUT = FeatureLayout(
    continuous=(2,),
    cont_mean=(0.0,),
    cont_std=(1.0,),
    categorical=(0, 1),
    vocab_sizes=(12, 3),
    cyclic=(0,),
    periods=(12.0,),
    offsets=(0.0,),
    names=("month", "daytype", "load"),
)


def _prior(statistic: str, group: str = "month", width: float = 2.0) -> NeighbourPrior:
    cfg = ModelConfig(
        prior_weight=0.5,
        prior_statistic=statistic,  # type: ignore[arg-type]
        prior_width=width,
        prior_group=group,
        prior_category_scale=2.0,
    )
    rows = np.array(
        [[m, d, 0.0] for m in (0, 1, 2, 5) for d in (0, 1, 2)], dtype=np.float64
    )  # 12 training rows
    labels = np.array([[m * 10.0 + d, 50.0 + (m == 5) * 40.0] for m, d, _ in rows])
    prior = NeighbourPrior(cfg, LAYOUT, (2,), len(rows))
    prior.fill(rows, labels)
    return prior


def _reference(prior: NeighbourPrior, query: np.ndarray) -> np.ndarray:
    """The same weights by hand: month kernel x day-type similarity, own month left out."""
    keys = prior.keys.numpy()
    kappa = (12 / (2 * math.pi * 2.0)) ** 2
    sim = prior.similarity[0].numpy()
    w = np.exp(kappa * (np.cos(2 * np.pi * (query[0] - keys[:, 0]) / 12) - 1))
    w = w * sim[int(query[1]), keys[:, 1].astype(int)]
    w = np.where(keys[:, 0] == query[0], 0.0, w) + 1e-20
    return w / w.sum()


def test_mean_and_median_match_a_hand_computation():
    query = np.array([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0]])
    mean = _prior("mean")(torch.from_numpy(query)).numpy()
    median = _prior("median")(torch.from_numpy(query)).numpy()
    both = _prior("mean+median")(torch.from_numpy(query)).numpy()
    prior = _prior("mean")
    values = prior.values.numpy()
    for i, q in enumerate(query):
        w = _reference(prior, q)
        np.testing.assert_allclose(mean[i], w @ values, rtol=1e-5)
        for c in range(values.shape[1]):  # weighted median: first value reaching half
            order = np.argsort(values[:, c], kind="stable")
            first = np.argmax(np.cumsum(w[order]) >= 0.5)
            assert median[i, c] == pytest.approx(values[order[first], c])
        np.testing.assert_allclose(both[i], (mean[i] + median[i]) / 2, rtol=1e-5)
    # Month 1's own rows are left out: its prior is what months 0 and 2 (and far 5) say.
    w = prior.weights(torch.from_numpy(query[:1]))[0]
    assert float(w[prior.keys[:, 0] == 1].max()) < 1e-12
    assert float(w[prior.keys[:, 0] == 0].min()) > float(w[prior.keys[:, 0] == 5].max())
    # The median resists the one month that is far off (month 5's second cell is 90, not 50).
    assert median[1, 1] == 50.0 and mean[1, 1] > 50.0


def test_day_types_are_alike_by_their_labels_and_unknown_codes_pool_all():
    prior = _prior("mean")
    sim = prior.similarity[0].numpy()
    # day types 0, 1, 2 differ by 1 in the first cell only: mean |d| = 0.5 per step
    assert sim[0, 1] == pytest.approx(math.exp(-((0.5 / 2.0) ** 2)))
    assert sim[0, 2] < sim[0, 1] < sim[0, 0] == 1.0
    assert (sim[3] == 1.0).all()  # the unknown code (3) is alike to every day type
    unknown = prior(torch.tensor([[1.0, 7.0, 0.0]], dtype=torch.float64))
    assert torch.isfinite(unknown).all()


def test_the_prior_stays_fp32_under_bf16_autocast():
    prior = _prior("mean+median")
    query = torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0]], dtype=torch.float32)
    plain = prior(query)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = prior(query)
    assert under.dtype == torch.float32 and torch.equal(under, plain)


def test_a_row_with_no_neighbour_falls_back_to_all_rows():
    # width tiny: only the row's own month would weigh anything, and it is left out
    prior = _prior("mean", width=1e-3)
    out = prior(torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64))
    assert torch.isfinite(out).all()
    lone = _prior("mean", group="")  # without a group, only identical rows are left out
    w = lone.weights(torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64))[0]
    own = (lone.keys == torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)).all(1)
    assert float(w[own].max()) < 1e-12 and float(w[~own].max()) > 0.1


def test_config_names_its_mistakes():
    with pytest.raises(ConfigError, match="prior_weight"):
        ModelConfig(prior_weight=1.5)
    with pytest.raises(ConfigError, match="prior_width"):
        ModelConfig(prior_weight=0.5, prior_width=0.0)
    with pytest.raises(ConfigError, match="preset custom"):
        ModelConfig(preset="custom", factory="a.b:c", prior_weight=0.5)
    with pytest.raises(ConfigError, match="over 256 MiB; set model.prior_weight: 0"):
        NeighbourPrior(ModelConfig(prior_weight=0.5), LAYOUT, (1000, 1000), 100)
    with pytest.raises(ConfigError, match="prior_group='weekday'"):
        NeighbourPrior(ModelConfig(prior_weight=0.5, prior_group="weekday"), LAYOUT, (2,), 1)


def _model(staged, **prior) -> torch.nn.Module:
    cfg = ModelConfig(d_model=16, heads=2, layers=1, embed_dim=4, prior_weight=0.4, **prior)
    return build_model(cfg, StagedDataset(staged).manifest.model_data(), data_dir=staged)


def test_the_model_blends_the_network_with_the_training_rows(staged):
    ds = StagedDataset(staged)
    model = _model(staged, prior_group="month").eval()
    train = np.sort(np.asarray(ds.split("train")))
    assert model.prior is not None and model.prior.n_rows == len(train)
    np.testing.assert_array_equal(model.prior.keys.numpy(), ds.features[train])
    x = torch.from_numpy(np.asarray(ds.features[ds.split("test")], dtype=np.float32))
    with torch.no_grad():
        net = model.denormalize(model.trunk(model.encoder(x)))
        torch.testing.assert_close(model.predict(x), 0.6 * net + 0.4 * model.prior(x))
    assert model.describe()["prior"]["training_rows"] == len(train)
    alone = _model(staged, prior_group="month", prior_train=False).train()
    torch.manual_seed(0)
    trained = alone(x)
    torch.manual_seed(0)
    torch.testing.assert_close(trained, alone.trunk(alone.encoder(x)))  # the network alone
    with pytest.raises(ConfigError, match="without the staged data"):
        build_model(dataclasses.replace(model.cfg), ds.manifest.model_data())


@pytest.mark.timeout(180)
def test_checkpoint_export_and_onnx_carry_the_prior(staged, tmp_path):
    ds = StagedDataset(staged)
    model = _model(staged, prior_group="month").eval()
    path = save_consolidated(
        tmp_path / "m.pt", model, model.cfg, ds.manifest.model_data(), {"stage": "test"}
    )
    loaded, _ = load_model(path)  # rebuilt without the data: the rows come as weights
    x = torch.tensor(np.asarray(ds.features[:9], dtype=np.float32))
    torch.testing.assert_close(loaded.predict(x), model.predict(x))

    class Predict(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m.predict(x)

    ep = export(Predict(loaded), (x[:4],), dynamic_shapes={"x": {0: Dim("batch", max=4096)}})
    torch.testing.assert_close(ep.module()(x), model.predict(x), rtol=1e-5, atol=1e-4)
    onnx_path = tmp_path / "m.onnx"
    torch.onnx.export(ep, (x[:4],), str(onnx_path), dynamo=True, optimize=False)
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    out = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_allclose(out, model.predict(x).detach().numpy(), rtol=1e-4, atol=1e-3)
