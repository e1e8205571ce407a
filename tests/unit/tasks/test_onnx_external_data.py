"""A model whose ONNX weights live beside model.onnx (model.onnx.data, as every model past
2 GB must: issue 55) goes through export, export's cache, the registry's bundle, a download
on another node and serving, with parity.

export.onnx_external_data_mb=0 writes the external data file for a custom model of 18.9 million
parameters (76 MB), so the path a 537-million-parameter model takes (its ONNX weights past
protobuf's 2 GB) runs here in seconds: the same torch.onnx save, the same file, the same copies.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from enn_core import export_cache
from enn_core.challenge import split_errors
from enn_core.checkpoint import save_consolidated
from enn_core.config import ExportConfig, RunConfig, load_config
from enn_core.config.loader import build
from enn_core.config.model import ModelConfig
from enn_core.data.dataset import StagedDataset
from enn_core.errors import ConfigError
from enn_core.inference import PredictionPath, load_calibration
from enn_core.model import ModelCode, build_model
from enn_core.onnx_program import ONNX_DATA, ort_runner
from enn_core.paths import Layout
from enn_core.serving import TableModel, decode
from enn_core.stage import make_context
from enn_core.stages import COLLAPSE_CHECK, DISTRIBUTED_TRAIN, EXPORT, STAGE_DATA
from enn_core.stages.demo import stage_synthetic

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[3]
FACTORY = "wide55.model:build"  # examples/wide_mlp, copied under a name no other test imports


def _custom(root: Path) -> RunConfig:
    pkg = root / "wide55"
    pkg.mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "wide_mlp" / "model.py", pkg / "model.py")
    model = build(
        ModelConfig,
        {"preset": "custom", "factory": FACTORY, "options": {"width": 1536, "blocks": 8}},
        root=ModelConfig,
        where="params.yaml",
    )
    export = ExportConfig(onnx_external_data_mb=0, parity_batch_sizes=(1, 7))
    return dataclasses.replace(RunConfig(), model=model, export=export)


def _trained(root: Path, cfg: RunConfig) -> Layout:
    """Staged synthetic data, the custom model trained a few full-batch steps, collapse-check."""
    data_dir = stage_synthetic(root, n_replicates=4)  # 36 validation rows: the champion rule's 30
    ds = StagedDataset(data_dir)
    torch.manual_seed(0)
    code = ModelCode.of(cfg.model, root)
    model = build_model(cfg.model, ds.manifest.model_data(), data_dir=data_dir, code=code)
    train = ds.split("train")
    x = torch.as_tensor(np.asarray(ds.features[train]), dtype=torch.float32)
    y = model.normalize(torch.as_tensor(np.asarray(ds.labels[train])))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(8):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    layout = Layout.for_root(root)
    out = DISTRIBUTED_TRAIN.output_dir(layout) / "model.pt"
    save_consolidated(out, model, cfg.model, ds.manifest.model_data(), {"precision": "fp32"})
    COLLAPSE_CHECK.work(cfg, make_context(cfg, layout, COLLAPSE_CHECK, "t"))
    return layout


def _eager(layout: Layout, cfg: RunConfig, x: np.ndarray) -> np.ndarray:
    """The trained model's prediction path in eager torch (what parity compares with)."""
    from enn_core.inference import load_trained

    _, model, _ = load_trained(
        STAGE_DATA.output_dir(layout),
        DISTRIBUTED_TRAIN.output_dir(layout),
        "t",
        ModelCode.of(cfg.model, layout.root),
    )
    cal, _ = load_calibration(COLLAPSE_CHECK.output_dir(layout))
    path = PredictionPath(model.float(), dataclasses.replace(cal, precision="fp32")).eval()
    with torch.inference_mode():
        return path(torch.from_numpy(x)).numpy()


def test_onnx_weights_beside_the_program_are_exported_cached_bundled_fetched_and_served(tmp_path):
    from tasks.tracking import Tracker
    from tasks.tracking.models import resolve_model_uri
    from tasks.tracking.registry import bundle, register

    root = tmp_path / "node-a"
    cfg = _custom(root)
    layout = _trained(root, cfg)
    summary = EXPORT.work(cfg, make_context(cfg, layout, EXPORT, "t"))
    out = EXPORT.output_dir(layout)
    # export: the weights are in model.onnx.data, which model.onnx names by its relative path
    assert summary.formats == {"torch_export": "ok", "onnx": "ok"}, summary
    assert (out / ONNX_DATA).stat().st_size > 4 * 8 * 1536 * 1536  # every block's weights
    program = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert {
        e.value for t in program.graph.initializer for e in t.external_data if e.key == "location"
    } == {ONNX_DATA}
    side = json.loads((out / "sidecar.json").read_text())
    assert side["formats"]["onnx"]["external_data"]["file"] == ONNX_DATA, side["formats"]

    # export's cache carries the weights with the program, checked by their sha256
    results = {k: dict(v) for k, v in side["formats"].items()}
    cache, again = tmp_path / "cache" / "key", tmp_path / "again"
    export_cache.store(cache, out, results)
    again.mkdir()
    assert export_cache.load(cache, again) == results
    assert (again / ONNX_DATA).read_bytes() == (out / ONNX_DATA).read_bytes()
    (cache / ONNX_DATA).write_bytes(b"damaged")
    assert export_cache.load(cache, tmp_path) is None  # a damaged weights file is not used

    # the registry: the bundle carries them, so the version's own score, and its registration,
    # load it (before: onnxruntime refused model.onnx without its weights)
    (root / "params.yaml").write_text("{}\n")
    store = load_config(None, [f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    tracker = Tracker(store, layout)
    run = tracker.client.create_run(tracker.experiment_id, run_name="export")
    enn_dir = bundle(layout, tmp_path / "bundle")
    assert (enn_dir / ONNX_DATA).is_file()
    split_errors(enn_dir, STAGE_DATA.output_dir(layout), "val")
    register(tracker.client, run.info.run_id, layout, "enn-big", {"enn.test": "1"})

    # another node fetches the version into its own folder and serves it from ONNX, with parity
    fetched = resolve_model_uri("models:/enn-big/1", tmp_path / "node-b", store.tracking.uri)
    assert (fetched / ONNX_DATA).is_file() and (fetched / "model.onnx").is_file()
    shutil.rmtree(out)  # nothing of node a's export is read from here on
    served = TableModel.load(fetched)
    ds = StagedDataset(STAGE_DATA.output_dir(layout))
    rows = np.sort(np.asarray(ds.split("test")))
    x = np.ascontiguousarray(ds.features[rows], dtype=np.float32)
    got = ort_runner(fetched / "model.onnx")(x)
    np.testing.assert_allclose(got, _eager(layout, cfg, x), rtol=1e-4, atol=1e-4)
    frame = served.predict(decode(x, ds.feature_specs))
    np.testing.assert_allclose(frame.to_numpy(), got.reshape(len(x), -1), rtol=1e-5, atol=1e-5)


def test_external_data_threshold_is_bounded_by_torchs_own():
    with pytest.raises(ConfigError, match=r"export\.onnx_external_data_mb=2048 must be in"):
        ExportConfig(onnx_external_data_mb=2048)
    assert ExportConfig().onnx_external_data_mb == 1536
