"""validate -> collapse-check -> export as stages, on staged synthetic data and a real tiny ENN
saved as a consolidated checkpoint (what the flow, `enn <stage>` and `dvc repro` run)."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
import torch

from enn_core.checkpoint import save_consolidated
from enn_core.config import ExportConfig, RunConfig
from enn_core.config.model import ModelConfig
from enn_core.data.dataset import StagedDataset
from enn_core.errors import CollapseError, StaleOutputError
from enn_core.events import read_events
from enn_core.inference import load_calibration
from enn_core.metric_names import NAIVE
from enn_core.model import build_model
from enn_core.paths import Layout
from enn_core.stage import make_context
from enn_core.stages import COLLAPSE_CHECK, EXPORT, VALIDATE
from enn_core.stages.demo import stage_synthetic

pytestmark = pytest.mark.timeout(180)
MODEL_CFG = ModelConfig(preset="tabular", d_model=32, layers=1, embed_dim=4)


def _project(root, steps: int, seed: int = 0) -> RunConfig:
    """Stage synthetic data under `root` and save a tabular ENN trained for `steps` full-batch
    steps."""
    data_dir = stage_synthetic(root)
    ds = StagedDataset(data_dir)
    torch.manual_seed(seed)
    model = build_model(MODEL_CFG, ds.manifest.model_data(), data_dir=data_dir)
    train = ds.split("train")
    x = torch.as_tensor(np.asarray(ds.features[train]), dtype=torch.float32)
    y = model.normalize(torch.as_tensor(np.asarray(ds.labels[train])))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_consolidated(
        root / "outputs" / "distributed-train" / "model.pt",
        model,
        MODEL_CFG,
        ds.manifest.model_data(),
        {"precision": "fp32"},
    )
    return RunConfig()


def _ctx(cfg, root, stage):
    return make_context(cfg, Layout.for_root(root), stage, "test")


@pytest.mark.slow  # fits the fitted baselines (gbt) on the staged rows
def test_untrained_model_fails_collapse_check_and_export_refuses(tmp_path, caplog):
    cfg = _project(tmp_path, steps=0)
    # validate reports the numbers and flags both naive predictors the model does not beat
    with caplog.at_level(logging.INFO):
        summary = VALIDATE.work(cfg, _ctx(cfg, tmp_path, VALIDATE))
    metrics = json.loads((tmp_path / "outputs/validate/metrics.json").read_text())
    assert (
        metrics["test/worse_than_naive_conditional"] == 1.0
        and metrics["val/worse_than_naive_cell_mean"] == 1.0
    )
    assert metrics["test/mae"] > metrics["test/naive_conditional_mae"] and summary.flags
    breakdown = json.loads((tmp_path / "outputs/validate/breakdown.json").read_text())
    assert (
        len(breakdown["splits"]["test"]["model"]["hour"]) == 8
        and len(breakdown["splits"]["val"]["model"]["section"]) == 6
    )
    assert any("naive_conditional" in f for f in breakdown["flags"])
    # the same numbers go to the MLflow child run through the events file
    events = list(read_events(tmp_path / "work" / "runs" / "test" / "validate"))
    logged = {e["name"]: e["value"] for e in events if e["type"] == "metric"}
    assert (
        logged["test/mae"] == metrics["test/mae"]
        and logged["val/worse_than_naive_conditional"] == 1.0
    )
    assert any(e["type"] == "event" and e["name"] == "naive_not_beaten" for e in events)
    # the fitted baselines on the same rows: reported (metrics, table, record), and named in
    # the one warning beside the naive predictors that beat the model
    for name in ("ridge", "gbt"):
        assert metrics[f"val/{name}_mae"] < metrics["val/naive_cell_mean_mae"], name
        assert metrics[f"test/worse_than_{name}"] == 1.0 and logged[f"test/{name}_mae"] > 0
        assert metrics[f"val/skill_vs_{name}"] < 0
        assert any(name in f for f in breakdown["flags"])
        assert breakdown["baselines"][name]["samples"] > 0, breakdown["baselines"]
        assert len(breakdown["splits"]["test"][name]["hour"]) == 8
    params = {e["name"]: e["value"] for e in events if e["type"] == "param"}
    assert "trees, stopped by" in params["resolved.validate.gbt"]
    table = next(e["rows"] for e in events if e["type"] == "table" and e["name"] == "baselines")
    predictors = [row["predictor"] for row in table]
    assert predictors == ["model", *NAIVE, "ridge", "gbt"]
    assert all(row["model_skill_test"] < 0 for row in table[1:]), table
    # the skill scores' bar: the best naive predictor for MAE on the validation rows, named in
    # metrics.json, the run's parameter and the console line
    best = metrics["naive_best"]
    assert best in NAIVE and params["resolved.validate.naive_best"] == best
    assert metrics["val/naive_best_mae"] == min(metrics[f"val/{n}_mae"] for n in NAIVE)
    assert metrics["test/naive_best_mae"] == metrics[f"test/{best}_mae"]
    assert metrics["test/skill_vs_naive_best"] == metrics[f"test/skill_vs_{best}"] < 0
    assert logged["val/skill_vs_naive_best"] == metrics["val/skill_vs_naive_best"]
    assert breakdown["naive_best"] == best
    line = next(r.getMessage() for r in caplog.records if "skill against" in r.getMessage())
    assert f"skill against {best} (the best naive on val rows): val " in line, line
    assert len(f"01:13:00 validate: {line}") <= 120, line
    assert f"test {metrics['test/skill_vs_naive_best']:.3g}" in line, line

    ctx = _ctx(cfg, tmp_path, COLLAPSE_CHECK)
    with pytest.raises(CollapseError, match="every candidate collapsed.*report: .*report.json"):
        COLLAPSE_CHECK.work(cfg, ctx)
    out = tmp_path / "outputs" / "collapse-check"
    assert (out / "FAILED").exists() and not (out / "calibration.json").exists()
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "failed" and report["candidates"]["raw"]["distance"] > 0
    tables = [e for e in read_events(ctx.run_dir) if e["type"] == "table"]  # diagnostics record
    assert {r["candidate"]: r["status"] for r in tables[-1]["rows"]}["raw"] == "failed"
    assert json.loads((out / "metrics.json").read_text())["collapse/passed"] == 0.0
    with pytest.raises(
        CollapseError, match="FAILED: collapse-check found every candidate collapsed"
    ):
        EXPORT.work(cfg, _ctx(cfg, tmp_path, EXPORT))
    assert not (tmp_path / "outputs" / "export").exists()


@pytest.mark.slow
def test_trained_model_passes_and_exports_in_real_units(tmp_path, caplog):
    cfg = _project(tmp_path, steps=150)
    VALIDATE.work(cfg, _ctx(cfg, tmp_path, VALIDATE))
    metrics = json.loads((tmp_path / "outputs/validate/metrics.json").read_text())
    # flat numbers, and one name: the naive predictor naive_best_mae and skill_vs_naive_best are
    assert all(isinstance(v, float) for k, v in metrics.items() if k != "naive_best")
    assert metrics["naive_best"] in NAIVE
    assert metrics["val/r2"] > 0.2 and metrics["test/worse_than_naive_cell_mean"] == 0.0

    summary = COLLAPSE_CHECK.work(cfg, _ctx(cfg, tmp_path, COLLAPSE_CHECK))
    assert summary.chosen == "raw"
    cal, meta = load_calibration(tmp_path / "outputs" / "collapse-check")
    assert cal.candidate == "raw" and meta["model_sha256"]

    # ONNX parity is covered by test_export.py; one ONNX export costs ~5 s of this tier's budget
    cfg = dataclasses.replace(
        cfg,
        export=ExportConfig(formats=("torch_export",), required=("torch_export",), parity_rows=25),
    )
    with caplog.at_level(logging.INFO, logger="enn"):
        EXPORT.work(cfg, _ctx(cfg, tmp_path, EXPORT))
    # it says what it does as each part starts (issue 39: no stage silent for long)
    assert "export: tracing the prediction path" in caplog.text
    assert "export: model.pt2: writing it, then parity on 25 of 40 held-out rows" in caplog.text
    caplog.clear()
    out = tmp_path / "outputs" / "export"
    side = json.loads((out / "sidecar.json").read_text())
    ds = StagedDataset(tmp_path / "outputs" / "stage-data")
    assert side["input"]["order"] == ["month", "daytype", "direction"] and side["output"][
        "shape"
    ] == ["batch", 6, 8]
    assert side["data_fingerprint"] == ds.fingerprint and side["input"]["features"][1]["vocab"] == [
        "sun",
        "mon",
        "tue",
    ]
    parity = json.loads((out / "parity.json").read_text())
    # parity ran on a sample of export.parity_rows of the held-out rows, and says so
    assert parity["torch_export"]["ok"] and parity["torch_export"]["rows"] == 25
    assert parity["torch_export"]["heldout_rows"] == 40
    assert side["parity_rows"] == 25 and side["heldout_rows"] == 40
    assert set(parity["torch_export"]["max_abs_diff"]) == {"1", "37", "64"}
    assert (out / "model.pt2").exists() and not (out / "model.onnx").exists()
    # the exported program answers in real units, like the model's predict
    x = np.asarray(ds.features[ds.split("test")], dtype=np.float32)
    with torch.no_grad():
        got = torch.export.load(str(out / "model.pt2")).module()(torch.from_numpy(x)).numpy()
    assert abs(float(got.mean()) - float(np.asarray(ds.labels[ds.split("test")]).mean())) < 5.0

    # the same checkpoint, calibration, data and settings again: what parity proved is copied
    first = {f.name: f.read_bytes() for f in out.iterdir() if f.name != "sidecar.json"}
    with caplog.at_level(logging.INFO, logger="enn"):
        EXPORT.work(cfg, _ctx(cfg, tmp_path, EXPORT))
    assert "copied, not made again" in caplog.text
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.name != "sidecar.json"} == first

    # a calibration made for another model file is refused
    _project(tmp_path / "other", steps=1, seed=1)
    (tmp_path / "other/outputs/distributed-train/model.pt").replace(
        tmp_path / "outputs/distributed-train/model.pt"
    )
    with pytest.raises(StaleOutputError, match="re-run collapse-check"):
        EXPORT.work(cfg, _ctx(cfg, tmp_path, EXPORT))
    assert (
        json.loads((out / "sidecar.json").read_text()) == side
    )  # the previous export is untouched
