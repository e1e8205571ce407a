"""configs/expressway.yaml (issue 4, quality on the real data) loads and declares the month
folds; configs/tabular.yaml carries the tabular preset's measured settings."""

from __future__ import annotations

import pytest

from enn_core.config import load_config
from enn_core.paths import Layout
from tests.fixtures.project import ROOT

CONFIG = ROOT / "configs" / "expressway.yaml"


@pytest.mark.timeout(60)
def test_expressway_config_declares_four_month_folds() -> None:
    cfg = load_config(CONFIG)
    assert cfg.data.source == "workbook"
    assert cfg.data.fold_key == "month"
    assert cfg.data.folds == (
        ("01", "02", "03"),
        ("04", "05", "06"),
        ("07", "08", "09"),
        ("10", "11", "12"),
    )
    months = [m for fold in cfg.data.folds for m in fold]
    assert sorted(months) == [f"{m:02d}" for m in range(1, 13)]  # each month in exactly one fold
    # validation comes from the training months only: a share of the non-test rows
    assert cfg.data.val_fold == -1 and 0 < cfg.data.val_fraction < 1
    assert cfg.runtime.world_size == 1


@pytest.mark.timeout(60)
def test_expressway_config_carries_the_measured_model_and_train_values() -> None:
    cfg = load_config(CONFIG)
    assert (cfg.model.preset, cfg.model.d_model, cfg.model.layers) == ("spatiotemporal", 32, 1)
    assert cfg.model.feature_dropout == pytest.approx(0.3)
    assert (cfg.train.loss, cfg.train.batch_size, cfg.train.epochs, cfg.train.patience) == (
        "huber",
        16,
        120,
        20,
    )
    assert cfg.train.huber_delta == pytest.approx(0.3)
    assert cfg.train.lr == pytest.approx(0.01)
    # the network blended with the neighbour prior, trained alone (docs/design.md)
    assert cfg.model.prior_weight == pytest.approx(0.8) and not cfg.model.prior_train
    assert (cfg.model.prior_statistic, cfg.model.prior_group) == ("kriging+median", "month")
    assert cfg.model.prior_width == pytest.approx(2.0)


@pytest.mark.timeout(60)
def test_expressway_config_path_resolves_to_the_shared_workbook_from_the_project_root() -> None:
    cfg = load_config(CONFIG)
    path = Layout.for_root(ROOT).resolve(cfg.data.path).resolve()
    assert path == (ROOT.parent / "shared" / "data" / "expressway_speeds.xlsx").resolve()


@pytest.mark.timeout(60)
def test_expressway_config_test_fold_override_selects_each_fold() -> None:
    for k in range(4):
        assert load_config(CONFIG, [f"data.test_fold={k}"]).data.test_fold == k


@pytest.mark.timeout(60)
def test_tabular_config_carries_the_measured_train_values() -> None:
    cfg = load_config(ROOT / "configs" / "tabular.yaml")
    assert cfg.model.preset == "tabular"
    assert (cfg.train.lr, cfg.train.weight_decay) == (pytest.approx(1e-3), pytest.approx(0.1))
    assert (cfg.train.epochs, cfg.train.patience) == (80, 20)
    # the metric's loss (issue 34): chosen on validation rows of several datasets
    assert cfg.train.loss == "l1"
