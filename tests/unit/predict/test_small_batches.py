"""The prediction flow's collapse-check on a few rows (issue 32): a spread over three rows is no
evidence of collapse, so below MIN_ROWS the check judges the rows beside the model's reference
rows (validation rows training's collapse-check kept), predicted in the same batch; a model
that really collapsed is held back at any batch size.

Two models over one staged synthetic dataset, each with the collapse-check output training
leaves beside it: a healthy one (the built-in preset blended fully with its neighbour prior,
which needs no training) and a constant one (every weight of the network zero, no prior)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from enn_core.checkpoint import load_model, save_consolidated
from enn_core.collapse.reference import MIN_ROWS
from enn_core.collapse.stage import run as training_check
from enn_core.config import load_config
from enn_core.config.data import DataConfig
from enn_core.data import staging
from enn_core.errors import CollapseError
from enn_core.paths import Layout
from enn_core.predict import flow_steps
from enn_core.stage import make_context
from enn_core.stages import COLLAPSE_CHECK, PREDICT, PREPARE_CHECKPOINT, STAGE_DATA
from tests.fixtures.predict import PREDICT_BASE

BASE = [*PREDICT_BASE, "data.synthetic.n_months=6", "collapse.max_rows=64"]
HEALTHY = ["model.prior_weight=1.0"]


def _trained(root: Path, overrides: list[str], constant: bool) -> Path:
    """A project at `root`: staged data, the model as distributed-train's model.pt, and the
    collapse-check output training leaves beside it (passed or held back)."""
    root.mkdir(parents=True)
    (root / "params.yaml").write_text("{}\n")
    cfg = load_config(None, [*BASE, *overrides])
    layout = Layout.for_root(root)
    staging.run(cfg, make_context(cfg, layout, STAGE_DATA, "r0"))
    PREPARE_CHECKPOINT.work(cfg, make_context(cfg, layout, PREPARE_CHECKPOINT, "r0"))
    trained = root / "outputs" / "distributed-train"
    trained.mkdir(parents=True)
    model, ckpt = load_model(root / "outputs/prepare-checkpoint/init.pt")
    if constant:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    save_consolidated(trained / "model.pt", model, cfg.model, ckpt.data.as_dict(), {})
    try:
        training_check(
            cfg,
            make_context(cfg, layout, COLLAPSE_CHECK, "r0"),
            staged=root / "outputs/stage-data",
            trained=trained,
        )
    except CollapseError:
        assert constant, "the healthy model failed training's collapse-check"
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("small")
    return {
        "healthy": _trained(base / "healthy", HEALTHY, constant=False),
        "constant": _trained(base / "constant", [], constant=True),
    }


def _rows(n: int) -> pd.DataFrame:
    """`n` hand-written rows of new inputs (every month, day type and direction in turn)."""
    months = [f"{m:02d}" for m in range(1, 7)]
    return pd.DataFrame(
        {
            "month": [months[i % 6] for i in range(n)],
            "daytype": [["mon", "tue", "wed", "thu", "fri", "sat", "sun"][i % 7] for i in range(n)],
            "direction": [["up", "down"][i % 2] for i in range(n)],
        }
    )


def _predict_and_check(root: Path, n: int) -> tuple[dict, Path]:
    """The prediction flow's predict and collapse-check on `n` new rows from a CSV, in the
    prediction pipeline's own folder (`prediction/outputs/`, as `enn run --flow prediction`)."""
    cfg = load_config(None, [*BASE, *HEALTHY])
    (root / "prediction").mkdir(exist_ok=True)
    (root / "prediction" / "params.yaml").write_text("{}\n")
    layout = Layout.for_root(root / "prediction")
    new = root / f"new-{n}.csv"
    _rows(n).to_csv(new, index=False)
    data = dataclasses.replace(
        DataConfig(),
        source="csv",
        path=str(new),
        feature_columns=("month", "daytype", "direction"),
        categorical=("month", "daytype", "direction"),
        cyclic=("month",),
        cyclic_periods=(12,),
        cyclic_starts=(1,),
        label_columns=(),
        label_shape=(),
    )
    staged = root / f"staged-{n}"
    shutil.rmtree(staged, ignore_errors=True)
    staging.stage_features(data, layout, staged, root / "outputs/stage-data/manifest.json")
    flow_steps.predict(
        cfg,
        make_context(cfg, layout, PREDICT, f"p{n}"),
        input_dir=staged,
        model_path=root / "outputs/distributed-train/model.pt",
        calibration_name=COLLAPSE_CHECK.name,
    )
    ctx = make_context(cfg, layout, COLLAPSE_CHECK, f"c{n}")
    try:
        flow_steps.check_predictions(
            cfg,
            ctx,
            predictions_dir=layout.outputs / "predict",
            input_dir=staged,
            training_data_dir=root / "outputs/stage-data",
        )
    except CollapseError as e:
        assert "\n" not in str(e)
    out = ctx.output()
    return json.loads((out / "report.json").read_text()), out


@pytest.mark.parametrize("n", [1, 3])
def test_a_few_rows_of_a_healthy_model_are_released_beside_its_reference_rows(models, n):
    report, out = _predict_and_check(models["healthy"], n)
    assert report["released"] is True, report["reasons"]
    assert (out / "predictions.npy").is_file() and not (out / "HELD").exists()
    assert "reference rows" in report["evidence"] and f"{n} row(s)" in report["evidence"]
    assert report["measures"]["rows"] == n


@pytest.mark.parametrize("n", [1, 3, 500])
def test_a_constant_model_is_held_back_at_any_batch_size(models, n):
    report, out = _predict_and_check(models["constant"], n)
    assert report["released"] is False and (out / "HELD").is_file(), report
    assert (out / "held" / "predictions.npy").is_file()
    assert not (out / "predictions.npy").exists()
    assert any(r.startswith("spread_median 0 ") for r in report["reasons"]), report["reasons"]
    if n < MIN_ROWS:
        assert "reference rows" in report["evidence"]
    else:
        assert report["evidence"] == f"the {n} rows' own spread"


def test_without_reference_rows_a_few_rows_rest_on_trainings_verdict_and_ranges(models):
    """A model registered before reference rows were kept: its stored verdict (passed) and
    the ranges decide; non-finite predictions are held back at any batch size."""
    root = models["healthy"]
    (root / "outputs/collapse-check/reference.npy").rename(root / "reference.npy.aside")
    try:
        report, _ = _predict_and_check(root, 3)
        assert report["released"] is True
        assert "training's verdict on it (passed)" in report["evidence"], report["evidence"]
        preds = root / "prediction/outputs/predict/predictions.npy"
        bad = np.load(preds)
        bad[0, 0, 0] = np.nan
        np.save(preds, bad)
        cfg = load_config(None, [*BASE, *HEALTHY])
        with pytest.raises(CollapseError, match=r"non_finite_fraction 0\.01389 \(needs <= 0\)"):
            flow_steps.check_predictions(
                cfg,
                make_context(cfg, Layout.for_root(root / "prediction"), COLLAPSE_CHECK, "c-nan"),
                predictions_dir=root / "prediction/outputs/predict",
                input_dir=root / "staged-3",
                training_data_dir=root / "outputs/stage-data",
            )
    finally:
        (root / "reference.npy.aside").rename(root / "outputs/collapse-check/reference.npy")
