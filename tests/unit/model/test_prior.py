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
from enn_core.errors import ConfigError, DataError
from enn_core.inference import PredictionPath
from enn_core.model import build_model
from enn_core.model.encoding import FeatureLayout
from enn_core.model.enn import prior_rows
from enn_core.model.prior import NeighbourPrior, group_count
from tests.fixtures import train

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


def _prior(
    statistic: str, group: str = "month", width: float = 2.0, rows=None, labels=None
) -> NeighbourPrior:
    cfg = ModelConfig(
        prior_weight=0.5,
        prior_statistic=statistic,  # type: ignore[arg-type]
        prior_width=width,
        prior_group=group,
        prior_category_scale=2.0,
        prior_kriging_noise=0.3,
        prior_kriging_group_weight=0.5,
    )
    if rows is None:  # 12 training rows: months 0, 1, 2, 5 x day types 0, 1, 2
        rows = np.array([[m, d, 0.0] for m in (0, 1, 2, 5) for d in (0, 1, 2)], dtype=np.float64)
        labels = np.array([[m * 10.0 + d, 50.0 + (m == 5) * 40.0] for m, d, _ in rows])
    prior = NeighbourPrior(cfg, LAYOUT, (2,), len(rows), group_count(rows, cfg, LAYOUT))
    prior.fill(rows, labels)
    return prior


def _reference(keys: np.ndarray, query: np.ndarray) -> np.ndarray:
    """The weights by hand, from the definitions: a von Mises month kernel (width 2 months),
    day types alike by exp(-(d / 2)^2) with d = |a - b| / 2 (their mean grids differ by a - b
    in the first of two cells), the query's own month left out."""
    kappa = (12 / (2 * math.pi * 2.0)) ** 2
    w = np.exp(kappa * (np.cos(2 * np.pi * (query[0] - keys[:, 0]) / 12) - 1))
    w = w * np.exp(-((np.abs(query[1] - keys[:, 1]) / 2 / 2.0) ** 2))
    w = np.where(keys[:, 0] == query[0], 0.0, w)
    return w / w.sum()


def test_mean_and_median_match_a_hand_computation():
    query = np.array([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0]])
    mean = _prior("mean")(torch.from_numpy(query)).numpy()
    median = _prior("median")(torch.from_numpy(query)).numpy()
    both = _prior("mean+median")(torch.from_numpy(query)).numpy()
    prior = _prior("mean")
    keys, values = prior.keys.numpy(), prior.values.numpy()
    for i, q in enumerate(query):
        w = _reference(keys, q)
        np.testing.assert_allclose(mean[i], w @ values, rtol=1e-5)
        np.testing.assert_allclose(both[i], (mean[i] + median[i]) / 2, rtol=1e-5)
    # Month 1, day type 2: months 0 and 2 weigh alike and month 5 little, so the first cell's
    # weighted median is a month-0 or month-2 value (0-2 or 20-22), the second cell's 50.
    assert median[0, 0] in (0.0, 1.0, 2.0, 20.0, 21.0, 22.0) and median[0, 1] == 50.0
    # Month 4, day type 0: month 5 is the nearest (one month away) and month 2 the next; the
    # median resists month 5's far-off second cell (90), the mean does not.
    assert median[1, 1] == 50.0 and 50.0 < mean[1, 1] < 90.0
    w = prior.weights(torch.from_numpy(query[:1]))[0]
    assert float(w[prior.keys[:, 0] == 1].max()) == 0.0  # its own month: exactly nothing
    assert float(w.sum()) == pytest.approx(1.0)


def _kernel_by_hand(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Kriging's covariance from the definitions: sim(day type) * sim(load) * (1 + 0.5 *
    sim(month)), the month by a von Mises of width 2, day types by exp(-(|a - b| / 2 / 2)^2)
    (as in _reference), the load by a Gaussian of one standard deviation (`std`)."""
    kappa = (12 / (2 * math.pi * 2.0)) ** 2
    month = np.exp(kappa * (np.cos(2 * np.pi * (a[:, None, 0] - b[None, :, 0]) / 12) - 1))
    day = np.exp(-((np.abs(a[:, None, 1] - b[None, :, 1]) / 2 / 2.0) ** 2))
    std = b[:, 2].std() if b[:, 2].std() > 0 else 1.0
    load = np.exp(-0.5 * ((a[:, None, 2] - b[None, :, 2]) / std) ** 2)
    return day * load * (1 + 0.5 * month)


def _kriging_by_hand(keys: np.ndarray, labels: np.ndarray, query: np.ndarray) -> np.ndarray:
    """A Gaussian-process posterior mean, noise 0.3, each cell centred on its rows' mean."""
    mean = labels.mean(0)
    system = _kernel_by_hand(keys, keys) + 0.3 * np.eye(len(keys))
    return mean + _kernel_by_hand(query, keys) @ np.linalg.solve(system, labels - mean)


def test_kriging_is_a_gaussian_process_over_the_other_months():
    prior = _prior("kriging")
    keys, labels = prior.keys.numpy(), prior.values.numpy().astype(np.float64)
    # month 4 is not a training month: all rows; month 1 is: its rows are left out
    query = np.array([[4.0, 0.0, 0.0], [1.0, 2.0, 0.0]])
    got = prior(torch.from_numpy(query)).numpy()
    np.testing.assert_allclose(got[0], _kriging_by_hand(keys, labels, query[:1])[0], rtol=1e-5)
    other = keys[:, 0] != 1
    by_hand = _kriging_by_hand(keys[other], labels[other], query[1:])[0]
    np.testing.assert_allclose(got[1], by_hand, rtol=1e-5)
    # the same as a prior that never had month 1 (its own similarity table, from its rows)
    without = _prior("kriging", rows=keys[other], labels=labels[other])
    np.testing.assert_allclose(got[1], without(torch.from_numpy(query[1:])).numpy()[0], rtol=1e-4)
    # month 3 lies between months 2 and 5: kriging follows the months' trend (0, 10, 20 ... 50
    # in the first cell), and the average with the median is the two statistics' mean
    trend = prior(torch.tensor([[3.0, 0.0, 0.0]], dtype=torch.float64)).numpy()[0]
    assert 20.0 < trend[0] < 50.0
    both = _prior("kriging+median")(torch.from_numpy(query)).numpy()
    median = _prior("median")(torch.from_numpy(query)).numpy()
    np.testing.assert_allclose(both, (got + median) / 2, rtol=1e-5)


def test_kriging_is_refused_without_a_group_or_with_a_bad_noise():
    with pytest.raises(ConfigError, match="needs model.prior_group"):
        ModelConfig(prior_weight=0.5, prior_statistic="kriging")
    with pytest.raises(ConfigError, match=r"prior_kriging_noise=0.0 is outside \[1e-06, 1e\+06\]"):
        ModelConfig(prior_weight=0.5, prior_kriging_noise=0.0)
    prior = _prior("kriging")
    cfg = ModelConfig(prior_weight=0.5, prior_statistic="kriging", prior_group="month")
    short = NeighbourPrior(cfg, LAYOUT, (2,), prior.n_rows, 3)  # sized for 3 months, given 4
    with pytest.raises(DataError, match="sized for 3 values of its group feature"):
        short.fill(prior.keys.numpy(), prior.values.numpy())


def test_a_month_sent_with_float_noise_is_still_its_own_month():
    for statistic in ("kriging", "mean+median"):
        prior = _prior(statistic)
        exact = prior(torch.tensor([[1.0, 2.0, 0.0]], dtype=torch.float64))
        noisy = prior(torch.tensor([[1.0 + 1e-6, 2.0, 0.0]], dtype=torch.float64))
        torch.testing.assert_close(noisy, exact)  # month 1's rows left out in both


def test_kriging_refuses_a_group_key_with_too_many_values():
    """A continuous or high-cardinality group would mean a rows^3 solve per value."""
    cfg = ModelConfig(prior_weight=0.5, prior_statistic="kriging", prior_group="month")
    with pytest.raises(ConfigError, match="use a group key with few values"):
        NeighbourPrior(cfg, LAYOUT, (1,), 4096, 1100)


@pytest.mark.parametrize(("group", "kept"), [("month", True), ("", False), ("daytype", False)])
def test_whole_validation_months_join_the_prior_only_when_it_leaves_their_month_out(
    tmp_path, group, kept
):
    """With whole validation months (data.val_by_key), a prior that does not leave the month
    out would predict a validation row from its own month's other rows: those rows stay out."""
    cfg = train.tiny_cfg(
        "data.fold_key=month",
        "data.folds=[['01'],['02'],['03'],['04']]",
        "data.val_by_key=true",
        "data.val_fraction=0.34",
    )
    staged = train.staged_dir(tmp_path, cfg)
    ds = StagedDataset(staged)
    features, _ = prior_rows(staged, group)
    want = ["train", "val"] if kept else ["train"]
    assert len(features) == sum(len(ds.split(n)) for n in want)
    (tmp_path / "random").mkdir()
    random_rows = train.staged_dir(tmp_path / "random", train.tiny_cfg())
    features, _ = prior_rows(random_rows, "")  # rows drawn from the training months: kept
    assert len(features) == sum(len(StagedDataset(random_rows).split(n)) for n in ("train", "val"))


def test_day_types_are_alike_by_their_labels_and_unknown_codes_pool_all():
    prior = _prior("mean")
    sim = prior.log_similarity[0].exp().numpy()
    # day types 0, 1, 2 differ by 1 in the first cell only: mean |d| = 0.5 per step
    assert sim[0, 1] == pytest.approx(math.exp(-((0.5 / 2.0) ** 2)))
    assert sim[0, 2] < sim[0, 1] < sim[0, 0] == 1.0
    assert (sim[3] == 1.0).all()  # the unknown code (3) is alike to every day type
    unknown = prior(torch.tensor([[1.0, 7.0, 0.0]], dtype=torch.float64))
    assert torch.isfinite(unknown).all()


def test_a_value_no_training_row_has_keeps_the_month_kernel():
    """Day type 2 is in the vocabulary but no training row has it: it is alike to every day
    type, and the months still weigh by distance."""
    rows = np.array([[m, d, 0.0] for m in (0, 1, 2, 5) for d in (0, 1)], dtype=np.float64)
    labels = np.array([[m * 10.0 + d, 50.0] for m, d, _ in rows])
    prior = _prior("mean", rows=rows, labels=labels)
    w = prior.weights(torch.tensor([[1.0, 2.0, 0.0]], dtype=torch.float64))[0].numpy()
    month = prior.keys[:, 0].numpy()
    assert w[month == 1].max() == 0.0
    # von Mises, width 2: one month away 0.885, four months away 0.254
    assert w[month == 0].min() / w[month == 5].max() == pytest.approx(0.885 / 0.254, rel=0.01)


def test_left_out_rows_stay_out_however_far_the_others_are():
    """A day type seen in one month only: its own row and month are left out even when every
    other row is far in label terms (similarity below 1e-20); the nearest allowed rows carry
    the weight instead of the plain mean of all rows."""
    rows = [[m, d, 0.0] for m in range(6) for d in (0, 1)] + [[3, 2, 0.0]]
    labels = [[50.0 + d, 50.0] for m, d, _ in rows[:-1]] + [[0.0, 0.0]]  # day type 2: far off
    prior = _prior("mean", rows=np.array(rows, dtype=np.float64), labels=np.array(labels))
    assert float(prior.log_similarity[0][2, 0].exp()) < 1e-20
    w = prior.weights(torch.tensor([rows[-1]], dtype=torch.float64))[0].numpy()
    month = prior.keys[:, 0].numpy()
    assert w[month == 3].max() == 0.0 and w.sum() == pytest.approx(1.0)
    assert w[(month == 2) | (month == 4)].sum() > 0.5  # the neighbouring months, not all rows
    out = prior(torch.tensor([rows[-1]], dtype=torch.float64)).numpy()[0]
    assert out[0] > 49.0  # not pulled to the all-row mean by its own label (0)


def test_one_group_only_falls_back_to_the_mean_of_all_rows():
    rows = np.array([[3, d, 0.0] for d in (0, 1, 2)], dtype=np.float64)
    labels = np.array([[10.0 * d, 1.0] for d in (0, 1, 2)])
    prior = _prior("mean", rows=rows, labels=labels)
    out = prior(torch.tensor([[3.0, 1.0, 0.0]], dtype=torch.float64)).numpy()[0]
    np.testing.assert_allclose(out, [10.0, 1.0], rtol=1e-6)
    lone = _prior("mean", group="")  # without a group, only identical rows are left out
    w = lone.weights(torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64))[0]
    own = (lone.keys == torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)).all(1)
    assert float(w[own].max()) == 0.0 and float(w[~own].max()) > 0.1


def test_a_continuous_feature_weighs_by_its_spread():
    rows = np.array([[m, 0, load] for m in (0, 6) for load in (0.0, 1.0, 2.0, 3.0)])
    labels = np.array([[100.0 - 10 * load, 0.0] for _, _, load in rows])
    prior = _prior("mean", group="", rows=rows, labels=labels)
    std = float(np.std(rows[:, 2]))
    assert float(prior.cont_std[0]) == pytest.approx(std)
    w = prior.weights(torch.tensor([[3.0, 0.0, 1.0]], dtype=torch.float64))[0].numpy()
    load = rows[:, 2]
    # month 3 is as far from 0 as from 6: the load alone decides, by a Gaussian of one std
    ratio = math.exp(-0.5 * (1.0 / std) ** 2)  # load 2 (or 0) against load 1
    assert w[load == 2].sum() / w[load == 1].sum() == pytest.approx(ratio, rel=1e-6)


def test_the_prior_stays_fp32_under_bf16_autocast():
    prior = _prior("mean+median")
    query = torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0]], dtype=torch.float32)
    plain = prior(query)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = prior(query)
    assert under.dtype == torch.float32 and torch.equal(under, plain)


def test_config_names_its_mistakes():
    with pytest.raises(ConfigError, match="prior_weight"):
        ModelConfig(prior_weight=1.5)
    with pytest.raises(ConfigError, match="prior_width"):
        ModelConfig(prior_weight=0.5, prior_width=0.0)
    with pytest.raises(ConfigError, match="preset custom"):
        ModelConfig(preset="custom", factory="a.b:c", prior_weight=0.5)
    with pytest.raises(ConfigError, match="row-cells; set model.prior_weight: 0"):
        NeighbourPrior(ModelConfig(prior_weight=0.5), LAYOUT, (100, 100), 200)
    wide = dataclasses.replace(LAYOUT, vocab_sizes=(12, 5000))
    with pytest.raises(ConfigError, match="'daytype' has 5000 values"):
        NeighbourPrior(ModelConfig(prior_weight=0.5), wide, (2,), 10)
    with pytest.raises(ConfigError, match="prior_group='weekday'"):
        NeighbourPrior(ModelConfig(prior_weight=0.5, prior_group="weekday"), LAYOUT, (2,), 1)


def _model(staged, **prior) -> torch.nn.Module:
    cfg = ModelConfig(d_model=16, heads=2, layers=1, embed_dim=4, prior_weight=0.4, **prior)
    return build_model(cfg, StagedDataset(staged).manifest.model_data(), data_dir=staged)


def test_the_model_blends_the_network_with_the_training_rows(staged):
    ds = StagedDataset(staged)
    model = _model(staged, prior_group="month").eval()
    # the training and validation rows: a validation row's prior leaves its own month out
    train = np.sort(np.concatenate([np.asarray(ds.split(n)) for n in ("train", "val")]))
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
@pytest.mark.parametrize("statistic", ["mean+median", "kriging+median"])
def test_checkpoint_export_and_onnx_carry_the_prior(staged, tmp_path, statistic):
    ds = StagedDataset(staged)
    model = _model(staged, prior_group="month", prior_statistic=statistic).eval()
    path = save_consolidated(
        tmp_path / "m.pt", model, model.cfg, ds.manifest.model_data(), {"stage": "test"}
    )
    loaded, _ = load_model(path)  # rebuilt without the data: the rows come as weights
    x = torch.tensor(np.asarray(ds.features[:9], dtype=np.float32))
    torch.testing.assert_close(loaded.predict(x), model.predict(x))

    ep = export(
        PredictionPath(loaded).eval(), (x[:4],), dynamic_shapes={"x": {0: Dim("batch", max=4096)}}
    )
    torch.testing.assert_close(ep.module()(x), model.predict(x), rtol=1e-5, atol=1e-4)
    onnx_path = tmp_path / "m.onnx"
    torch.onnx.export(ep, (x[:4],), str(onnx_path), dynamo=True, optimize=False)
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    out = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_allclose(out, model.predict(x).detach().numpy(), rtol=1e-4, atol=1e-3)
