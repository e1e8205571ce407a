"""Config values that feed arithmetic are refused outside the range where it stays finite and
solvable (one line naming the key), and inside it the neighbour prior and the cyclic encoder
build finite values: no OverflowError (a von Mises concentration at width 1e-300) or
LinAlgError (kriging at noise 1e-300) reaches the user as a traceback."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from enn_core.config import load_config
from enn_core.config.model import ModelConfig
from enn_core.errors import ConfigError
from enn_core.model.encoding import FeatureEncoder
from enn_core.model.prior import NeighbourPrior, group_count
from tests.unit.model.test_prior import LAYOUT

# the ranges enn_core/config/model.py allows
WIDTH, SCALE, NOISE, GROUP = (1e-3, 1e6), (1e-6, 1e9), (1e-6, 1e6), (0.0, 1e3)
PRIOR = {"prior_weight": 0.5, "prior_statistic": "kriging+mean+median", "prior_group": "month"}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("prior_width", 1e-300),
        ("prior_width", 1e300),
        ("cyclic_width", 1e-300),
        ("prior_category_scale", 1e-300),
        ("prior_kriging_noise", 1e-300),
        ("prior_kriging_noise", 1e300),
        ("prior_kriging_group_weight", 1e300),
        ("prior_kriging_group_weight", -1.0),
    ],
)
def test_values_outside_their_range_are_one_line(key, value):
    with pytest.raises(ConfigError, match=rf"model.{key}=.* is outside \["):
        ModelConfig(**PRIOR, **{key: value})


def test_tune_bounds_are_finite_and_ordered():
    space = 'tune.space={{"train.lr": {{"low": {}, "high": {}}}}}'
    for low, high, why in (
        ("0.001", ".inf", "must be a finite number"),
        ("-.inf", "0.1", "must be a finite number"),
        ("0.1", "0.001", "must be below high"),
        ("1", "100000000000000000000", "must be a finite number of at most"),
    ):
        with pytest.raises(ConfigError, match=why):
            load_config(None, [space.format(low, high)])


def _rows() -> tuple[np.ndarray, np.ndarray]:
    """Twelve training rows with duplicates (each point twice): kriging's kernel is singular
    without its noise."""
    rows = np.array([[m, d, 0.0] for m in (0, 1, 5) for d in (0, 1)] * 2, dtype=np.float64)
    labels = np.array([[m * 10.0 + d, 50.0 + m] for m, d, _ in rows])
    return rows, labels


EXTREMES = [
    {"prior_width": WIDTH[0], "prior_kriging_noise": NOISE[0], "prior_kriging_group_weight": 0.0},
    {"prior_width": WIDTH[1], "prior_kriging_noise": NOISE[1]},
    {"prior_kriging_noise": NOISE[0], "prior_kriging_group_weight": GROUP[1]},
    {"prior_category_scale": SCALE[0], "prior_kriging_noise": NOISE[0]},
    {"prior_category_scale": SCALE[1], "prior_width": WIDTH[0]},
]


@pytest.mark.parametrize("extreme", EXTREMES)
def test_the_prior_is_finite_at_the_ends_of_its_ranges(extreme):
    cfg = ModelConfig(**{**PRIOR, **extreme})
    rows, labels = _rows()
    prior = NeighbourPrior(cfg, LAYOUT, (2,), len(rows), group_count(rows, cfg, LAYOUT))
    try:
        prior.fill(rows, labels)
    except ConfigError as e:  # refused in one line naming what to change is fine too
        assert "model.prior_kriging_noise" in str(e)
        return
    query = torch.tensor([[1.0, 0.0, 0.0], [3.0, 2.0, 0.5], [11.0, 1.0, -2.0]])
    assert torch.isfinite(prior(query)).all()


@pytest.mark.parametrize("width", WIDTH)
def test_the_cyclic_encoder_is_finite_at_the_ends_of_its_width(width):
    cfg = ModelConfig(cyclic_basis=6, cyclic_width=width)
    enc = FeatureEncoder(LAYOUT, 4, 0.0, cfg.cyclic_basis, cfg.cyclic_width).eval()
    out = enc(torch.tensor([[0.0, 1.0, 0.3], [6.5, 2.0, -1.0]]))
    assert torch.isfinite(out).all()
