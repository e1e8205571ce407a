"""The champion rule over a sequence, through a real MLflow store (MlflowClient, pyfunc).

Tiny tabular ENNs trained for a few full-batch steps on staged synthetic data, each checked
by the real collapse-check, are registered one after another in one store: the better one is
promoted, a worse one is not, one that does not beat the conditional naive predictor is not,
the tags say why with the numbers, a retrain on other rows of the same task is compared on
its own validation rows, and a model of another task is not registered under the name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from enn_core.challenge import Score
from enn_core.checkpoint import save_consolidated
from enn_core.config import DataConfig, RunConfig, load_config
from enn_core.config.model import ModelConfig
from enn_core.data.dataset import StagedDataset
from enn_core.errors import DataError
from enn_core.metric_names import NAIVE, four
from enn_core.model import build_model
from enn_core.paths import Layout
from enn_core.predict.schema import remap_codes
from enn_core.serving import TableModel, decode, typed
from enn_core.stage import make_context
from enn_core.stages import COLLAPSE_CHECK, DISTRIBUTED_TRAIN, EXPORT, STAGE_DATA
from enn_core.stages.demo import stage_synthetic
from tests.fixtures.data import csv_data, sales, sales_csv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL_CFG = ModelConfig(preset="tabular", d_model=32, layers=1, embed_dim=4)


def trained(
    root: Path, steps: int, lr: float = 1e-2, data: DataConfig | None = None, **synthetic: int
) -> Layout:
    """Staged synthetic data (or `data`), a tabular ENN trained `steps` full-batch steps,
    collapse-check."""
    if data is None:  # 36 validation rows: the champion rule needs at least 30
        synthetic.setdefault("n_replicates", 4)
    data_dir = stage_synthetic(root, data=data, **synthetic)
    ds = StagedDataset(data_dir)
    torch.manual_seed(0)
    model = build_model(MODEL_CFG, ds.manifest.model_data(), data_dir=data_dir)
    train = ds.split("train")
    x = torch.as_tensor(np.asarray(ds.features[train]), dtype=torch.float32)
    y = model.normalize(torch.as_tensor(np.asarray(ds.labels[train])))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = DISTRIBUTED_TRAIN.output_dir(Layout.for_root(root)) / "model.pt"
    save_consolidated(out, model, MODEL_CFG, ds.manifest.model_data(), {"precision": "fp32"})
    layout = Layout.for_root(root)
    COLLAPSE_CHECK.work(RunConfig(), make_context(RunConfig(), layout, COLLAPSE_CHECK, "t"))
    return layout


@pytest.fixture
def store(tmp_path):
    """A Tracker's MLflow store and a function registering a layout's model under `name`."""
    from tasks.tracking import Tracker
    from tasks.tracking.registry import register

    (tmp_path / "params.yaml").write_text("{}\n")
    cfg = load_config(None, [f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    tracker = Tracker(cfg, Layout.for_root(tmp_path))
    client = tracker.client

    def reg(layout: Layout, name: str = ""):
        """Register under `name`, by default the name derived from the staged data's source
        (`enn-synthetic`, `enn-sales` for data/sales.csv)."""
        source = StagedDataset(STAGE_DATA.output_dir(layout)).manifest.source
        name = name or cfg.tracking.model_name(source.kind, source.path)
        run = client.create_run(tracker.experiment_id, run_name="export")
        return register(client, run.info.run_id, layout, name, {"enn.test": "1"})

    return client, reg


def test_the_champion_moves_for_a_better_model_only(tmp_path, store):
    client, reg = store
    first = reg(trained(tmp_path / "a", steps=25))
    assert first.champion and first.version == 1
    assert first.reason.startswith("the first")
    assert first.line().startswith("enn-synthetic version 1: champion: the first")
    assert client.get_model_version("enn-synthetic", "1").tags["enn.passes_rule"] == "yes"
    worse = reg(trained(tmp_path / "b", steps=10))
    assert worse.registered and not worse.champion, worse
    assert worse.val_mae > worse.champion_val_mae  # scored on the same rows
    better = reg(trained(tmp_path / "c", steps=60))
    assert better.champion and better.version == 3, better
    assert f"beats the champion's (version 1) {four(first.val_mae)}" in better.reason
    champion = client.get_model_version_by_alias("enn-synthetic", "champion")
    candidate = client.get_model_version_by_alias("enn-synthetic", "candidate")
    assert str(champion.version) == str(candidate.version) == "3"
    # the tags say why, with the numbers
    tags = client.get_model_version("enn-synthetic", "2").tags
    assert tags["enn.champion_decision"].startswith(f"val/mae {four(worse.val_mae)} does not beat")
    assert float(tags["enn.val_mae"]) == pytest.approx(worse.val_mae, rel=1e-5)
    assert float(tags["enn.champion_val_mae_on_these_rows"]) == pytest.approx(first.val_mae, 1e-5)
    assert float(tags["enn.naive_val_mae"]) > worse.val_mae
    assert (
        tags["enn.naive_predictor"] in NAIVE
        and worse.naive_predictor == tags["enn.naive_predictor"]
    )
    assert tags["enn.schema"] == client.get_model_version("enn-synthetic", "1").tags["enn.schema"]
    # each logged model names its registered version, as mlflow.register_model does: the run
    # page of its source run lists its registered models from that tag ("None" without it)
    for reg_ in (first, worse, better):
        versions = json.loads(client.get_logged_model(reg_.model_id).tags["mlflow.modelVersions"])
        assert versions == [{"name": "enn-synthetic", "version": str(reg_.version)}], versions


def test_a_better_version_replaces_a_first_champion_that_did_not_pass_the_rule(tmp_path, store):
    """Issue 54: on data with too few validation rows for the rule, the first version was
    champion and a strictly better second stayed candidate. One rule now: the better one is
    champion until one passes; the tags and the line say so."""
    client, reg = store
    few = {"n_replicates": 1}  # 9 validation rows: fewer than the rule's 30
    first = reg(trained(tmp_path / "a", steps=10, **few))
    assert first.champion and first.warning and "fewer than the 30" in first.reason, first
    better = reg(trained(tmp_path / "b", steps=60, **few))
    assert better.champion and better.version == 2 and better.warning, better
    assert "beats the champion's (version 1)" in better.reason, better.reason
    assert "neither passes the rule" in better.line(), better.line()
    tags = client.get_model_version("enn-synthetic", "2").tags
    assert tags["enn.passes_rule"] == "no" and tags["enn.champion_decision"] == better.reason
    assert tags["enn.champion_rule"].startswith("a version becomes champion when it beats")
    assert str(client.get_model_version_by_alias("enn-synthetic", "champion").version) == "2"


def test_a_model_no_better_than_the_naive_predictor_is_registered_not_promoted(tmp_path, store):
    """Sales that mostly follow the store: after 10 steps the model passes collapse-check but
    its validation MAE is above the per-store mean's (the conditional naive predictor)."""

    from tasks.tracking.registry import decide

    client, reg = store
    layout = trained(tmp_path / "a", steps=10, lr=3e-2, data=csv_data(sales(tmp_path)))
    report = json.loads((COLLAPSE_CHECK.output_dir(layout) / "report.json").read_text())
    chosen = report["chosen_metrics"]
    mae, naive = chosen["val/mae"], chosen["val/naive_best_mae"]
    assert mae > naive, chosen  # the premise: it does not beat the store's typical sales
    # the bar is the lowest of the means and medians on these rows, and it is named
    name = min(NAIVE, key=lambda n: chosen[f"val/{n}_mae"])
    assert naive == min(chosen[f"val/{n}_mae"] for n in NAIVE)
    weak = reg(layout, "enn-sales")
    # the first version is champion all the same (the prediction flow resolves @champion),
    # with a warning naming every predictor that beat it
    assert weak.registered and weak.version == 1 and weak.champion and weak.warning, weak
    assert weak.val_mae == pytest.approx(mae, rel=1e-4) and weak.naive_val_mae == naive
    tags = client.get_model_version("enn-sales", "1").tags
    why = tags["enn.champion_decision"]
    assert why.startswith(
        f"the first version, champion until one passes the rule: val/mae {four(weak.val_mae)} is "
        f"beaten by {name} {four(naive)}"
    ), why
    beaten = [n for n in NAIVE if chosen[f"val/{n}_mae"] <= mae]
    assert all(n in why for n in beaten), (beaten, why)
    assert float(tags["enn.val_mae"]) == pytest.approx(mae, rel=1e-4)
    assert float(tags["enn.naive_val_mae"]) == pytest.approx(naive, rel=1e-5)
    assert tags["enn.naive_predictor"] == weak.naive_predictor == name
    assert str(client.get_model_version_by_alias("enn-sales", "champion").version) == "1"
    # a second as weak is not promoted over it
    second = reg(layout, "enn-sales")
    assert not second.champion and "is beaten by" in second.reason, second
    # the gate comes first: beating a champion does not make up for it
    own = Score(mae=naive * 1.01, rows=registration_rows(layout), skipped=0)
    promote, why = decide(own, naive, Score(mae=naive * 2, rows=own.rows, skipped=0), "1")
    assert not promote and "naive predictor" in why


def test_a_collapse_report_from_before_the_medians_still_gates_on_the_conditional_mean():
    from tasks.tracking.registry import promotion_baseline

    old = {"val/mae": 2.0, "val/naive_conditional_mae": 2.5, "val/naive_cell_mean_mae": 4.0}
    assert promotion_baseline(old) == (2.5, "naive_conditional")
    new = {**old, "val/naive_conditional_median_mae": 1.5, "val/naive_best_mae": 1.5}
    assert promotion_baseline(new) == (1.5, "naive_conditional_median")
    assert promotion_baseline({"val/mae": 2.0}) == (None, "naive_conditional")


def registration_rows(layout: Layout) -> int:
    return len(StagedDataset(STAGE_DATA.output_dir(layout)).split("val"))


def test_a_retrain_on_more_rows_is_compared_on_its_own_validation_rows(tmp_path, store):
    _, reg = store
    first = reg(trained(tmp_path / "a", steps=10))
    more = trained(tmp_path / "b", steps=60, n_replicates=6)
    fp_a = StagedDataset(STAGE_DATA.output_dir(Layout.for_root(tmp_path / "a"))).fingerprint
    assert StagedDataset(STAGE_DATA.output_dir(more)).fingerprint != fp_a
    second = reg(more)
    assert second.champion, second
    assert f"on this version's {registration_rows(more)} validation rows" in second.reason
    assert second.champion_val_mae != pytest.approx(first.val_mae)  # other rows, other score


def test_another_task_is_not_registered_under_the_name(tmp_path, store):
    client, reg = store
    reg(trained(tmp_path / "a", steps=40))
    other = trained(tmp_path / "b", steps=40, n_sections=4)  # another label shape
    refused = reg(other)
    assert not refused.registered and refused.version is None
    assert "label shape" in refused.reason and "tracking.registered_model" in refused.reason
    assert len(client.search_model_versions("name='enn-synthetic'")) == 1
    assert reg(other, "enn-other").champion  # under its own name it is a champion


def test_a_model_of_other_features_is_not_registered_under_the_name(tmp_path, store):
    """The same label grid from other columns (`shop` instead of `store`) is another task."""
    client, reg = store
    champion = reg(trained(tmp_path / "a", steps=40, lr=3e-2, data=csv_data(sales(tmp_path))))
    assert champion.champion, champion
    (tmp_path / "other").mkdir()
    shops = sales_csv(tmp_path / "other" / "sales.csv", 300, first="shop")
    other = trained(tmp_path / "b", steps=40, lr=3e-2, data=csv_data(shops, first="shop"))
    refused = reg(other, champion.model)
    assert not refused.registered and refused.version is None, refused
    line = refused.line()
    assert "\n" not in line and line.startswith(f"{champion.model}: not registered: "), line
    assert "(version 1) is another task (features ['shop', 'month', 'temp'] vs ['store'," in line
    assert "tracking.registered_model=<name>" in line, line
    assert len(client.search_model_versions(f"name='{champion.model}'")) == 1
    assert str(client.get_model_version_by_alias(champion.model, "champion").version) == "1"


def test_a_retrain_on_appended_rows_of_the_same_csv_promotes_a_better_model(tmp_path, store):
    """`data/sales.csv` grows by 200 rows; the retrain (another fingerprint, more validation
    rows) is compared with the champion scored on the retrain's own validation rows."""
    from enn_core.challenge import score_split

    client, reg = store
    csv = sales(tmp_path)
    first_layout = trained(tmp_path / "a", steps=40, lr=3e-2, data=csv_data(csv))
    first = reg(first_layout)
    assert first.model == "enn-sales" and first.champion, first
    sales_csv(csv, 200, seed=1)  # the same file, 200 rows appended
    layout = trained(tmp_path / "b", steps=150, lr=3e-2, data=csv_data(csv))
    staged = STAGE_DATA.output_dir(layout)
    rows = registration_rows(layout)
    assert rows > registration_rows(first_layout)
    retrain = reg(layout)
    assert retrain.champion and retrain.version == 2, retrain
    # the champion's MAE on the retrain's validation rows, through its own prediction path
    theirs = score_split(bundle_of(first_layout, tmp_path), staged, "val")
    assert theirs.rows == rows and retrain.champion_val_mae == pytest.approx(theirs.mae)
    assert retrain.champion_val_mae != pytest.approx(first.val_mae)
    assert retrain.reason.startswith(
        f"val/mae {four(retrain.val_mae)} beats the champion's (version 1) {four(theirs.mae)} "
        f"on this version's {rows} validation rows, and it passes the rule: "
    ), retrain.reason
    tags = client.get_model_version("enn-sales", "2").tags
    assert tags["enn.champion_decision"] == retrain.reason
    assert tags["enn.val_rows"] == str(rows)
    assert float(tags["enn.champion_val_mae_on_these_rows"]) == pytest.approx(theirs.mae, 1e-5)
    assert (
        tags["enn.data_fingerprint"]
        != client.get_model_version("enn-sales", "1").tags["enn.data_fingerprint"]
    )
    assert str(client.get_model_version_by_alias("enn-sales", "champion").version) == "2"


def test_the_registered_pyfunc_takes_raw_columns_and_names_its_outputs(tmp_path, store):
    import mlflow.pyfunc
    from mlflow.exceptions import MlflowException
    from mlflow.models import Model

    from tasks.tracking import pyfunc

    client, reg = store
    layout = exported(trained(tmp_path / "a", steps=60))
    reg(layout)
    model = mlflow.pyfunc.load_model("models:/enn-synthetic@champion")
    inputs = {c.name: str(c.type) for c in model.metadata.get_input_schema().inputs}
    # each column typed as what it is (issue 32: month was Any, and the scoring server refused
    # every CSV body): month "01" is a whole number, which is what a CSV or JSON reader gives
    assert inputs == {
        "month": "DataType.long",
        "daytype": "DataType.string",
        "direction": "DataType.string",
    }, inputs
    ds = StagedDataset(STAGE_DATA.output_dir(layout))
    rows = np.sort(np.asarray(ds.split("test")))
    frame = typed(decode(np.asarray(ds.features[rows]), ds.feature_specs), ds.feature_specs)
    assert frame["month"].dtype == np.int64
    out = model.predict(frame)
    axes = ds.manifest.label_axis_values
    first = f"{axes['section'][0]}|{axes['hour'][0]}"
    assert out.shape == (len(rows), int(np.prod(ds.label_shape))) and out.columns[0] == first
    # real units: the same numbers as the staged rows' prediction path
    direct = TableModel.load(bundle_of(layout, tmp_path))
    assert np.allclose(out.to_numpy(), direct.predict(frame).to_numpy(), atol=1e-5)
    target = np.asarray(ds.labels[rows]).reshape(len(rows), -1)
    assert abs(out.to_numpy().mean() - target.mean()) < 0.2 * target.std()
    bad = frame.head(1).assign(daytype="someday")
    with pytest.raises(MlflowException) as e:
        model.predict(bad)
    assert "\n" not in e.value.message and "'someday' is not in the training vocabulary" in str(
        e.value.message
    )
    # a CSV as MLflow's CLI reads it (no schema: pandas' own types), and as the scoring server
    # reads a text/csv body (the signature's types)
    import io

    text = (
        frame.head(2).assign(month=[f"{m:02d}" for m in frame["month"].head(2)]).to_csv(index=False)
    )
    from mlflow.pyfunc.scoring_server import parse_csv_input

    for read in (
        pd.read_csv(io.StringIO(text)),
        parse_csv_input(io.StringIO(text), model.metadata.get_input_schema()),
    ):
        assert np.allclose(model.predict(read).to_numpy(), out.head(2).to_numpy())
    # nothing in the model's folder is code or a pickle
    local = Path(mlflow.artifacts.download_artifacts("models:/enn-synthetic@champion"))
    files = [p.relative_to(local) for p in local.rglob("*") if p.is_file()]
    assert not [
        f for f in files if f.suffix in {".pkl", ".pickle", ".py"} or "pickle" in f.name.lower()
    ], files
    # the MLmodel: pyfunc through the installed project's loader module (no python_model, no
    # code paths), an input example spelled as the source spells it, and the `onnx` flavor
    # pointing at the ONNX program, with the torch.export program beside it
    mlmodel = Model.load(str(local / "MLmodel"))
    flavor = mlmodel.flavors["python_function"]
    assert flavor["loader_module"] == pyfunc.__name__ == "tasks.tracking.pyfunc"
    assert flavor["data"] == "data/enn" and not flavor.get("code"), flavor
    assert "python_model" not in flavor and "cloudpickle_version" not in flavor, flavor
    assert (local / "data/enn/model.pt").is_file()
    onnx = mlmodel.flavors["onnx"]
    assert onnx["data"] == "data/enn/model.onnx" and (local / onnx["data"]).is_file(), onnx
    assert (local / "data/enn/model.pt2").is_file()
    assert (local / "data/enn/sidecar.json").is_file()
    info = mlmodel.saved_input_example_info
    assert info is not None and info["type"] == "dataframe", info
    example = json.loads((local / info["artifact_path"]).read_text())
    assert example["columns"] == ["month", "daytype", "direction"]
    assert len(example["data"]) == 2 and all(isinstance(v, str) for v in example["data"][0][1:])
    assert isinstance(example["data"][0][0], int), example  # month 1 (the source's "01")
    assert not any("pickle" in line for line in (local / "requirements.txt").read_text().split())


def exported(layout: Layout) -> Layout:
    """`layout` after the real export stage (model.onnx and model.pt2, with parity)."""
    EXPORT.work(RunConfig(), make_context(RunConfig(), layout, EXPORT, "t"))
    return layout


def bundle_of(layout: Layout, tmp: Path) -> Path:
    from tasks.tracking.registry import bundle

    dest = tmp / "bundle-copy"
    shutil.rmtree(dest, ignore_errors=True)
    return bundle(layout, dest)


def test_codes_are_mapped_by_spelling_and_unknown_categories_left_out():
    ours = [{"name": "d", "kind": "categorical", "vocab": ["b", "a", "c"]}]
    theirs = [{"name": "d", "kind": "categorical", "vocab": ["a", "b"]}]
    x, ok = remap_codes(np.array([[0.0], [1.0], [2.0]]), ours, theirs)
    assert x[:2, 0].tolist() == [1.0, 0.0] and ok.tolist() == [True, True, False]


def test_a_table_model_names_a_missing_column(tmp_path):
    layout = trained(tmp_path, steps=5)
    model = TableModel.load(bundle_of(layout, tmp_path))
    with pytest.raises(DataError, match=r"column\(s\) \['direction'\] missing"):
        model.predict(pd.DataFrame({"month": ["01"], "daytype": ["sun"]}))


def test_a_split_scored_in_chunks_of_rows_is_the_split_scored_at_once(tmp_path):
    """The registry's per-row errors and MAE of a model (and the champion's score) are made a
    chunk of rows at a time: 1.5 x 10^6 validation rows' predictions, targets and differences
    at once were over a GB. The numbers are those of the whole split (to float32 rounding: a
    batch of 7 rows is summed in another order than one of 37)."""
    from enn_core.challenge import row_errors, split_errors

    layout = trained(tmp_path / "a", steps=5)
    folder, staged = bundle_of(layout, tmp_path), STAGE_DATA.output_dir(layout)
    whole = split_errors(folder, staged, "val", chunk_rows=10**9)
    parts = split_errors(folder, staged, "val", chunk_rows=7)
    assert len(whole.kept) > 7 and whole.mae == pytest.approx(parts.mae, rel=1e-6)
    np.testing.assert_allclose(parts.errors, whole.errors, rtol=1e-6)
    model = TableModel.load(folder)
    ds = StagedDataset(staged)
    with torch.no_grad():
        pred = model.path(torch.from_numpy(np.asarray(ds.features[whole.rows], np.float32)))
    target = np.asarray(ds.targets[whole.rows], np.float64)
    np.testing.assert_allclose(whole.errors, row_errors(pred.numpy(), target), rtol=1e-5)
    assert whole.mae == pytest.approx(float(np.mean(np.abs(pred.numpy() - target))), rel=1e-5)
