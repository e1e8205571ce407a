"""New inputs are read as the model's training data was (a user walk-through: pointing the
prediction's data.source/data.path at a CSV of the real data failed on its text column,
because the prediction's params listed other categorical columns than training's), and a
table's one label axis names the outputs after its label columns (they were '0'..'23')."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.data import TABLE_CFG, run_stage, table_rows, write_table_csv


def _train(tmp_path, **cfg):
    tmp_path.mkdir(exist_ok=True)
    header, rows = table_rows()
    write_table_csv(tmp_path / "train.csv", rows, header)
    _, out = run_stage(tmp_path, source="csv", path="train.csv", **{**TABLE_CFG, **cfg})
    return json.loads((out / "manifest.json").read_text()), out, header, rows


def test_new_inputs_take_the_training_datas_categorical_and_cyclic_columns(tmp_path):
    trained, out, header, rows = _train(tmp_path, cyclic=("month",), cyclic_periods=(12,))
    new = tmp_path / "new"
    new.mkdir()
    features = header[:3]
    write_table_csv(new / "new.csv", [r[:3] for r in rows[:5]], features)
    _, staged = run_stage(  # the prediction's params name neither region nor month
        new,
        source="csv",
        path="new.csv",
        categorical=(),
        cyclic=(),
        cyclic_periods=(),
        cyclic_starts=(),
        features_only=True,
        training_manifest=str(out / "manifest.json"),
    )
    got = json.loads((staged / "manifest.json").read_text())
    assert got["feature_specs"] == trained["feature_specs"]
    assert got["n_rows"] == 5


def test_a_tables_one_label_axis_is_named_by_its_label_columns(tmp_path):
    trained, *_ = _train(tmp_path, label_shape=())
    assert list(trained["label_axis_values"].values()) == [["y0", "y1", "y2", "y3"]]
    two_d, *_ = _train(tmp_path / "2d")  # (2, 2): no one column per output: positions
    assert list(two_d["label_axis_values"].values()) == [["0", "1"], ["0", "1"]]


@pytest.mark.parametrize(
    "specs", [[{"kind": "categorical"}], [{"name": "m", "cyclic_period": "x"}]]
)
def test_a_training_manifest_whose_specs_lie_is_one_line(tmp_path, specs):
    from enn_core.errors import DataError

    _, out, header, rows = _train(tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "feature_specs": specs}))
    new = tmp_path / "new"
    new.mkdir()
    write_table_csv(new / "new.csv", [r[:3] for r in rows[:5]], header[:3])
    with pytest.raises(DataError, match=r"manifest.json: its feature specs do not say"):
        run_stage(
            new,
            source="csv",
            path="new.csv",
            features_only=True,
            training_manifest=str(out / "manifest.json"),
        )
