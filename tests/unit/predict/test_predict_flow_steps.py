"""The prediction flow's steps: predict new data, then release or hold back by collapse check."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from enn_core.config import load_config
from enn_core.data import staging
from enn_core.errors import CollapseError
from enn_core.paths import Layout
from enn_core.predict import flow_steps
from enn_core.stage import make_context
from enn_core.stages import COLLAPSE_CHECK, PREDICT, PREPARE_CHECKPOINT, STAGE_DATA

BASE = [
    "model.d_model=16",
    "model.heads=2",
    "model.layers=1",
    "data.synthetic.n_sections=4",
    "data.synthetic.n_hours=6",
    "predict.chunk_rows=64",
]


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "p"
    root.mkdir()
    (root / "params.yaml").write_text("{}\n")
    cfg = load_config(None, BASE)
    layout = Layout.for_root(root)
    staging.run(cfg, make_context(cfg, layout, STAGE_DATA, "r0"))
    PREPARE_CHECKPOINT.work(cfg, make_context(cfg, layout, PREPARE_CHECKPOINT, "r0"))
    staging.stage_features(
        cfg.data, layout, root / "new", root / "outputs/stage-data/manifest.json"
    )
    return root, cfg, layout


def _check(root, cfg, layout, preds_dir):
    ctx = make_context(cfg, layout, COLLAPSE_CHECK, "r1")
    return flow_steps.check_predictions(
        cfg,
        ctx,
        predictions_dir=preds_dir,
        input_dir=root / "new",
        training_data_dir=root / "outputs/stage-data",
    ), ctx.output()


def test_predict_then_release_predictions_with_the_training_spread(project):
    root, cfg, layout = project
    s = flow_steps.predict(
        cfg,
        make_context(cfg, layout, PREDICT, "r1"),
        input_dir=root / "new",
        model_path=root / "outputs/prepare-checkpoint/init.pt",
        calibration_name=COLLAPSE_CHECK.name,
    )
    assert s.input.endswith("new") and s.n_rows == 504
    # Stand-in for a skilled model's output on this input: the staged labels themselves.
    preds_dir = root / "outputs/predict"
    np.save(preds_dir / "predictions.npy", np.load(root / "outputs/stage-data/labels.npy"))
    summary, out = _check(root, cfg, layout, preds_dir)
    assert summary.released and (out / "predictions.npy").is_file() and not (out / "HELD").exists()
    report = json.loads((out / "report.json").read_text())
    assert report["collapsed"] is False and 0.9 < report["measures"]["spread_median"] < 1.1


def test_collapsed_predictions_are_held_back_with_the_report(project):
    root, cfg, layout = project
    preds_dir = root / "preds"
    preds_dir.mkdir()
    labels = np.load(root / "outputs/stage-data/labels.npy")
    np.save(
        preds_dir / "predictions.npy", np.broadcast_to(labels[:1], labels.shape).copy()
    )  # one map for all
    shutil.copy(root / "outputs/stage-data/manifest.json", preds_dir / "manifest.json")
    with pytest.raises(
        CollapseError, match=r"predictions collapsed \(spread_median 0 .*held back in"
    ) as e:
        _check(root, cfg, layout, preds_dir)
    assert "\n" not in str(e.value)
    out = COLLAPSE_CHECK.output_dir(layout)
    assert (out / "HELD").is_file() and (out / "held/predictions.npy").is_file()
    assert not (out / "predictions.npy").exists()
    report = json.loads((out / "report.json").read_text())
    assert report["released"] is False and report["measures"]["broadcast_fraction"] == 1.0


def test_a_champion_reads_inputs_staged_against_a_retrain_that_met_categories_in_another_order(
    tmp_path,
):
    """The prediction flow stages new inputs against the latest training manifest. When that
    retrain was not promoted and met the stores in another order (vocabularies grow in order
    of first appearance), the champion still reads each row by its category's spelling: the
    same predictions as inputs staged against its own manifest. A store only the retrain
    knows is one line naming it."""
    import dataclasses

    import pandas as pd

    from enn_core.errors import DataError
    from tests.fixtures.data import csv_data, sales_csv

    root = tmp_path / "p"
    (root / "data").mkdir(parents=True)
    (root / "params.yaml").write_text("{}\n")
    first = sales_csv(root / "data" / "first.csv", 80, seed=0)
    table = pd.read_csv(first)
    table[table["store"] != "store3"].to_csv(first, index=False)  # the champion never saw it
    later = sales_csv(root / "data" / "later.csv", 80, seed=3)
    new = sales_csv(root / "data" / "new.csv", 30, seed=4)
    model = ["model.preset=tabular", "model.d_model=16", "model.layers=1", "model.embed_dim=4"]
    cfg = dataclasses.replace(load_config(None, model), data=csv_data(first))
    layout = Layout.for_root(root)
    manifest = root / "outputs/stage-data/manifest.json"
    staging.run(cfg, make_context(cfg, layout, STAGE_DATA, "r0"))
    PREPARE_CHECKPOINT.work(cfg, make_context(cfg, layout, PREPARE_CHECKPOINT, "r0"))
    champion = root / "champion.pt"
    shutil.copy(root / "outputs/prepare-checkpoint/init.pt", champion)
    known = pd.read_csv(new)
    known = known[known["store"] != "store3"]
    known.to_csv(root / "data" / "known.csv", index=False)
    staging.stage_features(csv_data(root / "data" / "known.csv"), layout, root / "own", manifest)

    later_cfg = dataclasses.replace(cfg, data=csv_data(later))  # the retrain, not promoted
    staging.run(later_cfg, make_context(later_cfg, layout, STAGE_DATA, "r1"))
    vocab = json.loads(manifest.read_text())["feature_specs"][0]["vocab"]
    own_vocab = json.loads((root / "own/manifest.json").read_text())["feature_specs"][0]["vocab"]
    assert vocab[: len(own_vocab)] != own_vocab and set(own_vocab) < set(vocab)  # the premise
    staging.stage_features(csv_data(root / "data" / "known.csv"), layout, root / "in", manifest)
    staging.stage_features(csv_data(new), layout, root / "all", manifest)

    def predicted(input_dir):
        flow_steps.predict(
            cfg,
            make_context(cfg, layout, PREDICT, "r2"),
            input_dir=input_dir,
            model_path=champion,
            calibration_name=COLLAPSE_CHECK.name,
        )
        return np.load(root / "outputs/predict/predictions.npy")

    reference = predicted(root / "own")
    assert np.allclose(predicted(root / "in"), reference, atol=1e-6)
    with pytest.raises(DataError) as e:
        predicted(root / "all")
    row = int(np.flatnonzero(pd.read_csv(new)["store"] == "store3")[0])
    assert str(e.value).endswith(
        f"row {row}, feature 'store': category 'store3' was not seen in training (the model "
        "knows 3 values); drop those rows or retrain with them"
    ), e.value
    assert "\n" not in str(e.value)
