"""The exported model in MLflow: ONNX flavor, registered version, aliases, lineage.

After export succeeds, `register_export` logs `outputs/export/model.onnx` in the ONNX flavor
(signature and input example from the staged held-out rows) under the export stage's run,
with an `enn/` folder beside it holding what predict and warm start load: the consolidated
checkpoint, the chosen calibration, the sidecar, the collapse report and the `.pt2` program.
It registers the folder as a new version of `tracking.registered_model` and sets:

- alias `candidate`: every version that passed collapse-check (export only runs after a pass);
- alias `champion`: moved only when the chosen candidate's validation MAE beats the current
  champion's on the same dataset and split fingerprint, and beats the conditional naive
  predictor. Otherwise the version records why it was not promoted.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from enn_core.paths import Layout
from enn_core.stages import COLLAPSE_CHECK, DISTRIBUTED_TRAIN, EXPORT, STAGE_DATA, TRAINING

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

ENN_DIR = "enn"  # folder inside the logged model holding the files predict and warm start load


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _input_example(layout: Layout) -> np.ndarray:
    from enn_core.data.dataset import StagedDataset

    ds = StagedDataset(STAGE_DATA.output_dir(layout))
    rows = (
        np.asarray(ds.split("test"))[:2]
        if "test" in ds.manifest.get("splits", {})
        else np.arange(2)
    )
    return np.ascontiguousarray(ds.features[np.sort(rows)], dtype=np.float32)


def fingerprints(layout: Layout) -> dict[str, str]:
    """The dataset and split fingerprints a champion comparison must share."""
    manifest = _json(STAGE_DATA.output_dir(layout) / "manifest.json")
    split = json.dumps(
        {"def": manifest.get("split_definition"), "sizes": manifest.get("splits")}, sort_keys=True
    )
    import hashlib

    return {
        "enn.data_fingerprint": str(manifest.get("content_hash", "")),
        "enn.split_fingerprint": hashlib.sha256(split.encode()).hexdigest()[:16],
    }


def _decide_champion(
    client: MlflowClient, name: str, val_mae: float, naive_mae: float | None, fp: dict[str, str]
) -> tuple[bool, str]:
    if naive_mae is not None and not val_mae < naive_mae:
        return (
            False,
            f"validation MAE {val_mae:.4g} does not beat the conditional naive predictor's {naive_mae:.4g}",
        )
    try:
        current = client.get_model_version_by_alias(name, "champion")
    except mlflow_error():
        return True, "no champion yet"
    tags = current.tags
    if any(tags.get(k) != v for k, v in fp.items()):
        return False, (
            f"the champion (version {current.version}) was measured on another dataset or split; "
            "compare on the same data before promoting (or register under another tracking.registered_model)"
        )
    best = float(tags.get("enn.val_mae", "inf"))
    if val_mae < best:
        return (
            True,
            f"validation MAE {val_mae:.4g} beats the champion's {best:.4g} (version {current.version})",
        )
    return (
        False,
        f"validation MAE {val_mae:.4g} does not beat the champion's {best:.4g} (version {current.version})",
    )


def register_export(
    client: MlflowClient,
    run_id: str,
    layout: Layout,
    registered_model: str,
    lineage: dict[str, str],
) -> dict[str, Any]:
    import mlflow.onnx
    import onnx
    from mlflow.models import infer_signature

    export_dir = EXPORT.output_dir(layout)
    onnx_path = export_dir / "model.onnx"
    if not onnx_path.exists():
        return {
            "registered": False,
            "reason": f"{onnx_path} does not exist (ONNX export not produced)",
        }
    report = _json(COLLAPSE_CHECK.output_dir(layout) / "report.json")
    chosen = report.get("chosen_metrics") or {}
    val_mae = float(chosen.get("mae", float("nan")))
    naive_mae = chosen.get("naive_conditional_mae")
    example = _input_example(layout)
    import onnxruntime as ort

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    output = sess.run(None, {sess.get_inputs()[0].name: example})[0]
    signature = infer_signature(example, output)
    reqs = [f"{p}=={metadata.version(p)}" for p in ("onnx", "onnxruntime", "numpy")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        mlflow.onnx.save_model(
            onnx.load(str(onnx_path)),
            str(model_dir),
            signature=signature,
            input_example=example,
            pip_requirements=reqs,
            onnx_execution_providers=["CPUExecutionProvider"],
        )
        extra = model_dir / ENN_DIR
        extra.mkdir()
        for spec in TRAINING:
            for n in spec.bundle:
                src = spec.output_dir(layout) / n
                if src.exists():
                    shutil.copy2(src, extra / n)
        client.log_artifacts(run_id, str(model_dir), "model")
    try:
        client.create_registered_model(
            registered_model, description="ENN exported prediction path (real units)."
        )
    except mlflow_error():
        pass  # it exists already
    fp = fingerprints(layout)
    train = _json(DISTRIBUTED_TRAIN.output_dir(layout) / "metrics.json")
    trained = {
        "enn.world_size": str(train.get("world_size", "")),
        "enn.checkpoint_step": str(train.get("applied_steps", train.get("global_step", ""))),
    }
    tags = {
        **lineage,
        **trained,
        **fp,
        "enn.val_mae": f"{val_mae:.6g}",
        "enn.candidate": report.get("chosen", ""),
    }
    if naive_mae is not None:
        tags["enn.naive_conditional_val_mae"] = f"{float(naive_mae):.6g}"
    version = client.create_model_version(
        registered_model, f"runs:/{run_id}/model", run_id=run_id, tags=tags
    )
    client.set_registered_model_alias(registered_model, "candidate", version.version)
    promote, why = _decide_champion(
        client, registered_model, val_mae, None if naive_mae is None else float(naive_mae), fp
    )
    if promote:
        client.set_registered_model_alias(registered_model, "champion", version.version)
    client.set_model_version_tag(registered_model, version.version, "enn.champion_decision", why)
    return {
        "registered": True,
        "model": registered_model,
        "version": int(version.version),
        "champion": promote,
        "champion_reason": why,
        "val_mae": val_mae,
    }


def materialize(uri: str, dest: Path, tracking_uri: str | None = None) -> Path:
    """Download `models:/name@alias` into `dest` (replaced atomically): a local folder that DVC
    can hash, so a new champion re-runs predict. Returns `dest / "model.pt"`."""
    import tempfile

    from enn_core.atomic import atomic_dir

    with tempfile.TemporaryDirectory() as tmp, atomic_dir(dest) as out:
        local = resolve_model_uri(uri, Path(tmp), tracking_uri)
        for f in local.iterdir():
            shutil.copy2(f, out / f.name)
        (out / "SOURCE").write_text(f"{uri}\n")
    return dest / "model.pt"


def resolve_model_uri(uri: str, dest: Path, tracking_uri: str | None = None) -> Path:
    """`models:/name@alias` (or `runs:/...`) -> a local folder holding model.pt, calibration,
    sidecar (the `enn/` folder of the logged model), from `tracking_uri` (`tracking.uri`; None:
    MLflow's current one, the project's store)."""
    import mlflow
    import mlflow.artifacts

    if (
        tracking_uri
    ):  # global, as the Tracker sets it: MLflow resolves models:/ by the current registry
        mlflow.set_tracking_uri(tracking_uri)
    local = Path(
        mlflow.artifacts.download_artifacts(
            artifact_uri=uri.rstrip("/") + f"/{ENN_DIR}", dst_path=str(dest)
        )
    )
    if not (local / "model.pt").exists():
        raise FileNotFoundError(
            f"{uri}: no {ENN_DIR}/model.pt in the registered model; re-run export to register it"
        )
    return local


def mlflow_error() -> type[Exception]:
    """MLflow's exception class (mlflow is imported when tracking runs, not with this module)."""
    from mlflow.exceptions import MlflowException

    return MlflowException
