"""The registered model's default name: `enn-<data>`, from the training data, the same in the
training pipeline and in the prediction pipeline (whose input is staged against the training
manifest); `tracking.registered_model` overrides it."""

from __future__ import annotations

from enn_core.config import load_config
from enn_core.config.tracking import TrackingConfig
from enn_core.paths import Layout
from enn_core.stage import make_context
from enn_core.stages import STAGE_DATA
from tasks.tracking.models import champion_uri, model_name
from tests.fixtures.data import TABLE_CFG, table_rows, write_table_csv

CSV = [
    "data.source=csv",
    "data.path=data/sales.csv",
    "data.feature_columns=[region,month,temp]",
    f"data.categorical=[{','.join(TABLE_CFG['categorical'])}]",
    f"data.label_columns=[{','.join(TABLE_CFG['label_columns'])}]",
    "data.label_shape=[2,2]",
    "data.naive_keys=[region]",
]


def test_the_name_is_derived_from_the_data():
    cfg = TrackingConfig()
    assert cfg.model_name("csv", "data/sales.csv") == "enn-sales"
    assert cfg.model_name("parquet", "/srv/in/Sales 2024 (v2).parquet") == "enn-Sales-2024-v2"
    assert cfg.model_name("synthetic", "../enn_core/data/synthetic.py") == "enn-synthetic"
    assert cfg.model_name("synthetic", None) == "enn-synthetic"
    assert TrackingConfig(registered_model=" shop ").model_name("csv", "a.csv") == "shop"


def test_training_and_prediction_name_the_same_model(tmp_path):
    from enn_core.data.staging import run

    (tmp_path / "params.yaml").write_text("{}\n")
    assert model_name(load_config(None, []), tmp_path) == "enn-synthetic"  # the demo's data
    cfg = load_config(None, CSV)
    assert champion_uri(cfg, tmp_path) == "models:/enn-sales@champion"
    assert model_name(load_config(None, [*CSV, "tracking.registered_model=shop"]), tmp_path) == (
        "shop"
    )
    # the prediction pipeline: new inputs (another file) staged against the training
    # manifest, which names the training data
    (tmp_path / "data").mkdir()
    header, rows = table_rows(24)
    write_table_csv(tmp_path / "data" / "sales.csv", rows, header)
    run(cfg, make_context(cfg, Layout.for_root(tmp_path), STAGE_DATA, "t"))
    predicting = [
        *CSV[:1],
        "data.path=data/next_week.csv",
        *CSV[2:],
        "data.features_only=true",
        "data.training_manifest=outputs/stage-data/manifest.json",
    ]
    assert model_name(load_config(None, predicting), tmp_path) == "enn-sales"
    synthetic_prediction = [
        "data.features_only=true",
        "data.training_manifest=outputs/none/manifest.json",
    ]
    assert model_name(load_config(None, synthetic_prediction), tmp_path) == "enn-synthetic"
