"""validate stage: the trained model's metrics on the validation and test splits, in real units.

Reads the staged data (`outputs/stage-data/`) and the consolidated checkpoint
(`outputs/distributed-train/model.pt`); writes `outputs/validate/metrics.json` (flat
`"<split>/<metric>": number`, which `dvc metrics show` and the MLflow child run both show) and
`breakdown.json` (per label-axis value, e.g. per hour and per section, and the flags in words).

Both naive predictors of `enn_core.baselines` (the conditional naive predictor and the per-cell
mean) are scored on the same rows; `<split>/worse_than_<naive>` is 1 when the model does not
beat it (MAE not strictly lower), and the flag is also logged and written as an event.

The model runs its plain `predict` in fp32 (collapse-check compares precisions and paths).
R² is variance-weighted over outputs: 1 - sum of squared errors / sum over outputs of the
squared deviations from that output's mean over the split's rows.

Run: `enn validate`. The batched inference helpers here are shared by collapse-check and export.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from enn_core.atomic import atomic_dir, write_json
from enn_core.baselines import conditional_naive_predict, per_cell_mean_predict
from enn_core.checkpoint import load_model
from enn_core.data.dataset import StagedDataset
from enn_core.errors import ConfigError, DataError, StaleOutputError

SPLITS: tuple[str, ...] = ("val", "test")
NAIVE_NAMES: tuple[str, ...] = ("naive_conditional", "naive_cell_mean")
MODEL_FILE = "model.pt"


def select_device(requested: str) -> tuple[torch.device, str]:
    """The inference device and why it was chosen."""
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                "runtime.device=cuda but no CUDA device is visible; set runtime.device=auto or cpu"
            )
        return torch.device("cuda"), "runtime.device=cuda"
    if requested == "auto" and torch.cuda.is_available():
        return torch.device("cuda"), "runtime.device=auto and a CUDA device is visible"
    return torch.device("cpu"), f"runtime.device={requested}" + (
        " and no CUDA device" if requested == "auto" else ""
    )


def predict_rows(
    fn: Callable[[torch.Tensor], torch.Tensor],
    features: np.ndarray,
    rows: np.ndarray,
    batch_size: int,
    device: torch.device | str = "cpu",
) -> np.ndarray:
    """`fn` (raw features in, real units out) over `features[rows]` in batches -> float32 array."""
    outs: list[np.ndarray] = []
    with torch.inference_mode():
        for start in range(0, len(rows), batch_size):
            idx = np.asarray(rows[start : start + batch_size])
            x = torch.as_tensor(np.asarray(features[idx]), dtype=torch.float32, device=device)
            outs.append(fn(x).float().cpu().numpy())
    if not outs:
        raise DataError(
            "no rows to predict; the split is empty (re-run stage-data with a non-empty split)"
        )
    return np.concatenate(outs, axis=0)


def regression_metrics(pred: np.ndarray, target: np.ndarray) -> dict[str, float]:
    """MAE, RMSE and variance-weighted R² over every output of every row (float64 sums)."""
    if pred.shape != target.shape:
        raise DataError(
            f"prediction shape {pred.shape} != target shape {target.shape}; re-run the model's stage"
        )
    p = pred.reshape(len(pred), -1).astype(np.float64)
    y = target.reshape(len(target), -1).astype(np.float64)
    err = p - y
    sse = float(np.sum(err**2))
    sst = float(np.sum((y - y.mean(axis=0, keepdims=True)) ** 2))
    return {
        "mae": float(np.mean(np.abs(err))),
        "rmse": math.sqrt(sse / err.size),
        "r2": 1.0 - sse / sst if sst > 0 else float("nan"),
        "n_rows": float(len(p)),
    }


def axis_breakdown(
    pred: np.ndarray,
    target: np.ndarray,
    axes: Sequence[str],
    axis_values: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """MAE and RMSE per value of each label axis (e.g. per hour, per section); {} for flat labels."""
    shape = pred.shape[1:]
    if len(axes) != len(shape) or len(shape) < 2:
        return {}
    err = pred.astype(np.float64) - target.astype(np.float64)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for i, axis in enumerate(axes):
        other = tuple(d for d in range(err.ndim) if d != i + 1)
        mae = np.mean(np.abs(err), axis=other)
        rmse = np.sqrt(np.mean(err**2, axis=other))
        names = list((axis_values or {}).get(axis, [])) or [str(k) for k in range(shape[i])]
        out[axis] = {
            str(names[k]): {"mae": float(mae[k]), "rmse": float(rmse[k])} for k in range(shape[i])
        }
    return out


def evaluate_split(
    split: str,
    pred: np.ndarray,
    target: np.ndarray,
    naive: Mapping[str, np.ndarray],
    axes: Sequence[str] = (),
    axis_values: Mapping[str, Sequence[str]] | None = None,
) -> tuple[dict[str, float], dict, list[str]]:
    """Flat metrics, the breakdown and the flags (in words) of one split."""
    m = regression_metrics(pred, target)
    metrics = {f"{split}/{k}": v for k, v in m.items()}
    breakdown: dict = {"model": axis_breakdown(pred, target, axes, axis_values)}
    flags: list[str] = []
    for name, npred in naive.items():
        nm = regression_metrics(npred, target)
        metrics[f"{split}/{name}_mae"] = nm["mae"]
        metrics[f"{split}/{name}_rmse"] = nm["rmse"]
        worse = not m["mae"] < nm["mae"]
        metrics[f"{split}/worse_than_{name}"] = float(worse)
        breakdown[name] = axis_breakdown(npred, target, axes, axis_values)
        if worse:
            flags.append(
                f"{split}: the model's MAE {m['mae']:.4g} does not beat the {name} predictor's "
                f"{nm['mae']:.4g}; the model adds nothing over it on this split"
            )
    return metrics, breakdown, flags


def finite_or_none(metrics: Mapping[str, float]) -> dict[str, float | None]:
    """JSON without NaN (dvc and strict JSON readers refuse it): a non-finite value becomes null."""
    return {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}


def load_staged(staged: Path, trained: Path, stage: str) -> tuple[object, object, dict]:
    """(staged dataset, model in eval mode, checkpoint) for `stage` reading the staged data and
    the trained model's folder; checks they agree."""
    ds = StagedDataset(staged)
    if ds.labels is None:
        raise DataError(
            f"{ds.path} is features-only (no labels); {stage} needs the training data's labels: "
            "run it in the training flow (the prediction flow checks new data without targets)"
        )
    path = trained / MODEL_FILE
    if not path.exists():
        raise StaleOutputError(f"{path} not found; run {trained.name} first")
    model, ckpt = load_model(path)
    want, have = ckpt.get("data_fingerprint"), ds.fingerprint
    if want and have and want != have:
        raise StaleOutputError(
            f"{path} was trained on data {str(want)[:12]} but {staged} holds {str(have)[:12]}; "
            f"re-run {trained.name} (or {staged.name} with the training inputs)"
        )
    return ds, model, ckpt


def naive_predictions(ds: StagedDataset, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Both naive predictors of enn_core.baselines, fitted on the training rows, at `rows`.

    The conditional one needs the manifest's `naive_keys` (absent: only the per-cell mean)."""
    train = np.asarray(ds.split("train"))
    y_train = np.asarray(ds.labels[train])
    out: dict[str, np.ndarray] = {}
    names = list(ds.manifest.get("naive_keys") or [])
    if names:
        keys = ds.row_keys
        out["naive_conditional"] = conditional_naive_predict(
            y_train, keys.iloc[train], keys.iloc[np.asarray(rows)], names, len(rows)
        )
    out["naive_cell_mean"] = per_cell_mean_predict(y_train, len(rows))
    return out


def run(cfg, ctx, *, staged: Path, trained: Path) -> dict:
    """The validate stage: metrics.json + breakdown.json; returns the headline metrics."""
    ds, model, ckpt = load_staged(staged, trained, ctx.stage)
    device, reason = select_device(cfg.runtime.device)
    model.to(device)
    ctx.events.param("validate/device", f"{device} ({reason})")
    manifest = ds.manifest
    axes = manifest.get("label_axes") or []
    axis_values = manifest.get("label_axis_values") or {}
    metrics: dict[str, float] = {}
    breakdown: dict = {"label_axes": axes, "splits": {}}
    flags: list[str] = []
    for split in SPLITS:
        rows = np.asarray(ds.split(split))
        if len(rows) == 0:
            raise DataError(
                f"splits/{split}.npy is empty; re-run stage-data with a non-empty {split} split"
            )
        pred = predict_rows(model.predict, ds.features, rows, cfg.predict.batch_size, device)
        target = np.asarray(ds.labels[rows])
        m, b, f = evaluate_split(
            split, pred, target, naive_predictions(ds, rows), axes, axis_values
        )
        metrics.update(m)
        breakdown["splits"][split] = b
        flags.extend(f)
    breakdown["flags"] = flags
    breakdown["data_fingerprint"] = ds.fingerprint
    with atomic_dir(ctx.output()) as tmp:
        write_json(tmp / "metrics.json", finite_or_none(metrics))
        write_json(tmp / "breakdown.json", breakdown)
    for flag in flags:
        ctx.logger.warning(flag)
        ctx.events.event("naive_not_beaten", message=flag)
    ctx.events.metrics({k: v for k, v in metrics.items() if math.isfinite(v)})
    out = ctx.output()
    ctx.events.artifact(out / "metrics.json")
    ctx.events.artifact(out / "breakdown.json")
    return {
        "metrics_file": str(out / "metrics.json"),
        "breakdown": str(out / "breakdown.json"),
        "flags": flags,
        **{k: metrics[k] for k in ("val/mae", "test/mae", "test/rmse", "test/r2")},
    }
