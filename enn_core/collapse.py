"""collapse-check stage: find prediction collapse and its cause, and never hide it.

ENN-PyTorch shipped one 39 x 24 map repeated for all 168 groups. This stage measures the
model's predictions on the validation rows and compares candidate prediction paths side by side:

- `raw`: the model as trained (under the training run's autocast precision), batched;
- `calibrated`: raw plus a per-output affine (slope bounded to [0, collapse.calibration_slope_max])
  fitted on the validation rows; it is judged on rows its affine was not fitted on
  (cross-fitting over collapse.calibration_folds folds) by skill as well as spread: median
  correlation with the targets >= collapse.min_correlation and MAE below the conditional naive
  predictor's. Stretching a flat output therefore cannot pass;
- `fp32`: the model re-run in fp32 (only when the run used bf16 or fp16);
- `per_sample`: the model re-run at batch size 1 (exposes batch-level broadcast bugs).

Measures per candidate: the spread ratio of enn_core.baselines (median and 10th percentile),
the fraction of flat outputs, broadcast detection (distinct inputs, near-identical outputs),
correlation with the targets. `collapse.order` picks the first candidate that passes.

Outputs (`outputs/collapse-check/`, replaced atomically as one directory):
- passed: `report.json` (every candidate, how far each was from passing, the cause, the chosen
  candidate's validation metrics), `calibration.json` (+ `slope.npy`/`intercept.npy` for the
  calibrated candidate).
- all collapsed: `report.json` and a `FAILED` marker, no `calibration.json`; then the stage raises
  CollapseError. A previous passing output is replaced, so export (which requires
  calibration.json and refuses on FAILED) can never ship a stale calibration.

Values are never nudged apart to hide ties. `PredictionPath(model, calibration)` is the chosen
candidate's full path (raw features in, real units out): export exports it, predict runs it.
`measure_predictions` is the targets-free check the prediction flow runs on new data.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from enn_core.atomic import atomic_dir, write_json
from enn_core.baselines import collapse_stats
from enn_core.errors import CollapseError, DataError, StaleOutputError
from enn_core.validate import (
    evaluate_split,
    load_staged,
    naive_predictions,
    predict_rows,
    select_device,
)

CANDIDATES: tuple[str, ...] = ("raw", "calibrated", "fp32", "per_sample")
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
FAILED_MARKER = "FAILED"
CALIBRATION_FILE = "calibration.json"
REPORT_FILE = "report.json"
# Batched vs batch-size-1 outputs further apart than this x label std mean the model's output
# for a row depends on the other rows of its batch (fp32 kernels differ by ~1e-6 relative).
BATCH_DEPENDENCE_TOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 5e-3}
BROADCAST_SAMPLE_ROWS = 512
STD_CHUNK_ROWS = 65536


@dataclass(frozen=True)
class Calibration:
    """The chosen prediction path: candidate, autocast precision, optional per-output affine."""

    candidate: str = "raw"
    precision: str = "fp32"
    slope: np.ndarray | None = None
    intercept: np.ndarray | None = None


class PredictionPath(nn.Module):
    """Raw feature vector [B, F] in, calibrated real units [B, *label_shape] out.

    Encoding and normalization live in the model (`model.predict`); this adds the candidate's
    precision, the per-sample loop and the affine. `per_sample` loops rows, so it is correct
    for a batch-dependent model but cannot be exported with a dynamic batch.
    """

    def __init__(self, model: nn.Module, calibration: Calibration | None = None) -> None:
        super().__init__()
        cal = calibration or Calibration()
        if cal.candidate not in CANDIDATES:
            raise StaleOutputError(
                f"calibration candidate {cal.candidate!r} is not one of {CANDIDATES}; re-run collapse-check"
            )
        self.model = model
        self.candidate = cal.candidate
        self.precision = cal.precision
        self.per_sample = cal.candidate == "per_sample"
        self.has_affine = cal.slope is not None
        if self.has_affine:
            self.register_buffer(
                "slope", torch.as_tensor(np.asarray(cal.slope), dtype=torch.float32)
            )
            self.register_buffer(
                "intercept", torch.as_tensor(np.asarray(cal.intercept), dtype=torch.float32)
            )

    def _batch(self, x: torch.Tensor) -> torch.Tensor:
        if self.precision in AUTOCAST:
            with torch.autocast(x.device.type, dtype=AUTOCAST[self.precision]):
                y = self.model.predict(x)
        else:
            y = self.model.predict(x)
        y = y.float()
        if self.has_affine:
            y = y * self.slope + self.intercept
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.per_sample:
            return torch.cat([self._batch(x[i : i + 1]) for i in range(x.shape[0])], dim=0)
        return self._batch(x)


# ---------------------------------------------------------------- measures


def _flat(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float64).reshape(len(a), -1)


def column_std(a: np.ndarray, chunk_rows: int = STD_CHUNK_ROWS) -> np.ndarray:
    """Per-output std across rows of [N, ...] (e.g. a memmap of millions of predictions) in
    float64, read in chunks so memory stays bounded; shifted by the first row for accuracy."""
    n = len(a)
    if n == 0:
        raise DataError("no rows to measure; predict at least one row")
    shift = np.asarray(a[:1], dtype=np.float64).reshape(1, -1)
    s1 = np.zeros(shift.shape[1])
    s2 = np.zeros(shift.shape[1])
    for start in range(0, n, chunk_rows):
        d = (
            np.asarray(a[start : start + chunk_rows], dtype=np.float64).reshape(-1, shift.shape[1])
            - shift
        )
        s1 += d.sum(axis=0)
        s2 += (d**2).sum(axis=0)
    return np.sqrt(np.maximum(s2 / n - (s1 / n) ** 2, 0.0))


def target_spread(labels: np.ndarray) -> np.ndarray:
    """Per-output standard deviation across rows (the reference spread; e.g. training targets)."""
    return column_std(labels)


def spread_measures(pred: np.ndarray, reference: np.ndarray, flat_tolerance: float) -> dict:
    """Spread ratio (median, p10) and flat fraction against `reference`: the targets of the same
    rows (same shape as `pred`; the ratio is enn_core.baselines.collapse_stats), or, without
    targets, a per-output std such as `target_spread(training labels)`."""
    pred_std = column_std(pred)
    if reference.shape == pred.shape:
        stats = collapse_stats(pred, reference)
        ref_std = column_std(reference)
        median, p10 = float(stats["median_ratio"]), float(stats["p10_ratio"])
    else:
        ref_std = np.asarray(reference, dtype=np.float64).reshape(-1)
        if ref_std.size != pred_std.size:
            raise DataError(
                f"reference spread has {ref_std.size} outputs but predictions have {pred_std.size}; "
                "use the training targets of the same model"
            )
        # the same ratio as baselines.spread_ratio, with the reference spread given directly
        ratio = pred_std[ref_std > 0] / ref_std[ref_std > 0]
        median, p10 = (
            (float(np.median(ratio)), float(np.percentile(ratio, 10))) if ratio.size else (0.0, 0.0)
        )
    ok = ref_std > 0
    flat = pred_std[ok] < flat_tolerance * ref_std[ok]
    return {
        "spread_median": median,
        "spread_p10": p10,
        "flat_fraction": float(flat.mean()) if flat.size else 1.0,
        "n_outputs": int(pred_std.size),
    }


def broadcast_measures(
    features: np.ndarray, pred: np.ndarray, tol_abs: float, seed: int = 0
) -> dict:
    """Rows with distinct inputs whose outputs are identical within `tol_abs` (max |diff|)."""
    rows = np.arange(len(pred))
    if len(rows) > BROADCAST_SAMPLE_ROWS:  # pairwise cost: a seeded sample is enough to see it
        rows = np.sort(
            np.random.default_rng(seed).choice(rows, BROADCAST_SAMPLE_ROWS, replace=False)
        )
    x = np.asarray(features[rows], dtype=np.float64).reshape(len(rows), -1)
    p = _flat(pred[rows])
    _, input_id = np.unique(x, axis=0, return_inverse=True)
    input_id = input_id.reshape(-1)
    n_distinct = int(input_id.max()) + 1 if len(input_id) else 0
    if n_distinct < 2:
        return {"broadcast_fraction": 0.0, "distinct_inputs": n_distinct, "rows_checked": len(p)}
    t = torch.as_tensor(p)
    dist = torch.cdist(t, t, p=float("inf")).numpy()
    same_input = input_id[:, None] == input_id[None, :]
    dist[same_input] = np.inf
    shared = dist.min(axis=1) <= tol_abs
    return {
        "broadcast_fraction": float(shared.mean()),
        "distinct_inputs": n_distinct,
        "rows_checked": int(len(p)),
        "min_output_distance": float(dist.min()),
    }


def correlation_measures(pred: np.ndarray, target: np.ndarray) -> dict:
    """Per-output Pearson correlation across rows with the targets: median and p10."""
    p, y = _flat(pred), _flat(target)
    pc, yc = p - p.mean(axis=0), y - y.mean(axis=0)
    den = np.sqrt((pc**2).sum(axis=0) * (yc**2).sum(axis=0))
    ok = den > 0
    corr = (pc * yc).sum(axis=0)[ok] / den[ok]
    if corr.size == 0:  # a flat prediction has no correlation at all
        return {"correlation_median": 0.0, "correlation_p10": 0.0}
    return {
        "correlation_median": float(np.median(corr)),
        "correlation_p10": float(np.percentile(corr, 10)),
    }


def criteria(measures: Mapping, cfg, *, skill: bool) -> list[dict]:
    """Each pass criterion with its value, threshold and whether it holds."""
    rows = [
        ("spread_median", ">=", cfg.median_ratio_min),
        ("spread_p10", ">=", cfg.p10_ratio_min),
        ("flat_fraction", "<=", cfg.max_flat_fraction),
        ("broadcast_fraction", "<=", cfg.max_broadcast_fraction),
    ]
    if skill:
        rows.append(("correlation_median", ">=", cfg.min_correlation))
        rows.append(("mae", "<", measures.get("naive_conditional_mae", math.inf)))
    out = []
    for name, op, thr in rows:
        if name not in measures:  # e.g. no broadcast check without the inputs
            continue
        v = float(measures[name])
        ok = v >= thr if op == ">=" else (v <= thr if op == "<=" else v < thr)
        gap = 0.0 if ok else abs(thr - v) if math.isfinite(v) else math.inf
        out.append(
            {
                "measure": name,
                "value": v,
                "op": op,
                "threshold": float(thr),
                "ok": bool(ok),
                "gap": gap,
            }
        )
    return out


def measure_predictions(
    pred: np.ndarray,
    reference: np.ndarray,
    cfg,
    *,
    features: np.ndarray | None = None,
    label_std: float | None = None,
) -> dict:
    """The collapse verdict for predictions, with or without targets.

    `reference`: targets on the same rows, or (new data, no targets) the per-output spread of the
    training targets (`target_spread(train_labels)`). `cfg`: the collapse config section.
    Returns the measures, each criterion, and `collapsed` with the reasons.
    """
    m = spread_measures(pred, reference, cfg.flat_tolerance)
    if features is not None:
        targets = reference.shape == pred.shape
        scale = label_std or float(np.mean(column_std(reference) if targets else reference))
        m.update(broadcast_measures(features, pred, cfg.broadcast_tolerance * max(scale, 1e-12)))
    if reference.shape == pred.shape:
        m.update(correlation_measures(pred, reference))
    crit = criteria(m, cfg, skill=False)
    fails = [c for c in crit if not c["ok"]]
    return {
        "measures": m,
        "criteria": crit,
        "collapsed": bool(fails),
        "reasons": [describe(c) for c in fails],
    }


def describe(c: Mapping) -> str:
    return f"{c['measure']} {c['value']:.4g} (needs {c['op']} {c['threshold']:.4g})"


# ---------------------------------------------------------------- calibration


def fit_affine(
    pred: np.ndarray, target: np.ndarray, slope_max: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per-output least-squares y ~ a p + b with a clipped to [0, slope_max] (b refitted).

    An output with no spread keeps slope 1: there is nothing to stretch, only an offset.
    """
    p, y = _flat(pred), _flat(target)
    pm, ym = p.mean(axis=0), y.mean(axis=0)
    var = ((p - pm) ** 2).mean(axis=0)
    cov = ((p - pm) * (y - ym)).mean(axis=0)
    slope = np.where(var > 0, cov / np.where(var > 0, var, 1.0), 1.0)
    slope = np.clip(slope, 0.0, slope_max)
    intercept = ym - slope * pm
    shape = pred.shape[1:]
    return slope.reshape(shape).astype(np.float32), intercept.reshape(shape).astype(np.float32)


def cross_fit(
    pred: np.ndarray, target: np.ndarray, folds: int, slope_max: float, seed: int = 0
) -> np.ndarray:
    """Calibrated predictions of every row from an affine fitted on the other folds' rows."""
    n = len(pred)
    parts = np.array_split(np.random.default_rng(seed).permutation(n), min(folds, n))
    out = np.empty(pred.shape, dtype=np.float32)
    for part in parts:
        fit_rows = np.setdiff1d(np.arange(n), part)
        a, b = fit_affine(pred[fit_rows], target[fit_rows], slope_max)
        out[part] = pred[part] * a + b
    return out


# ---------------------------------------------------------------- candidates


@dataclass(frozen=True)
class CheckRows:
    """What the check reads, already in memory: the validation rows and their references."""

    features: np.ndarray
    target: np.ndarray
    naive: Mapping[str, np.ndarray]
    label_std: float
    axes: tuple[str, ...] = ()
    axis_values: Mapping | None = None


def run_precision(requested: str, ckpt: Mapping | None) -> tuple[str, str]:
    """The raw candidate's precision and why: the config, else what the training run recorded."""
    if requested != "auto":
        return requested, f"collapse.precision={requested}"
    rec = ((ckpt or {}).get("meta") or {}).get("precision")
    if isinstance(rec, Mapping):
        rec = rec.get("precision") or rec.get("choice") or rec.get("dtype")
    if rec in ("fp32", "bf16", "fp16"):
        return str(rec), f"the training run recorded precision={rec}"
    return "fp32", "the checkpoint records no training precision; fp32 assumed"


def _judge(name: str, pred: np.ndarray, rows: CheckRows, cfg, *, skill: bool) -> dict:
    metrics, _, _ = evaluate_split(
        "val", pred, rows.target, rows.naive, rows.axes, rows.axis_values
    )
    m = spread_measures(pred, rows.target, cfg.flat_tolerance)
    m.update(broadcast_measures(rows.features, pred, cfg.broadcast_tolerance * rows.label_std))
    m.update(correlation_measures(pred, rows.target))
    m["mae"] = metrics["val/mae"]
    # the skill bar: the conditional naive predictor, or the per-cell mean without naive keys
    m["naive_conditional_mae"] = metrics.get(
        "val/naive_conditional_mae", metrics.get("val/naive_cell_mean_mae", math.inf)
    )
    crit = criteria(m, cfg, skill=skill)
    fails = [c for c in crit if not c["ok"]]
    return {
        "status": "failed" if fails else "passed",
        "measures": m,
        "criteria": crit,
        "reasons": [describe(c) for c in fails],
        # how far from passing: the largest shortfall relative to its threshold
        "distance": max((c["gap"] / max(abs(c["threshold"]), 1e-12) for c in fails), default=0.0),
        "metrics": metrics,
    }


def check_candidates(
    model: nn.Module, rows: CheckRows, cfg, precision: str, device: torch.device | str = "cpu"
) -> tuple[dict, Calibration | None]:
    """Every candidate side by side, the cause, and the choice (`cfg`: the collapse section)."""
    idx = np.arange(len(rows.features))

    def run_path(cal: Calibration) -> np.ndarray:
        return predict_rows(
            PredictionPath(model, cal).to(device), rows.features, idx, cfg.batch_size, device
        )

    preds: dict[str, np.ndarray] = {"raw": run_path(Calibration("raw", precision))}
    cands: dict[str, dict] = {"raw": _judge("raw", preds["raw"], rows, cfg, skill=False)}
    slope, intercept = fit_affine(preds["raw"], rows.target, cfg.calibration_slope_max)
    if len(idx) < 2 * 2:
        cands["calibrated"] = {
            "status": "not_applicable",
            "reason": f"{len(idx)} validation rows: too few to fit and judge an affine on held-out rows",
        }
    else:
        preds["calibrated"] = cross_fit(
            preds["raw"], rows.target, cfg.calibration_folds, cfg.calibration_slope_max
        )
        cands["calibrated"] = _judge("calibrated", preds["calibrated"], rows, cfg, skill=True)
        cands["calibrated"]["slope"] = _slope_summary(slope, cfg.calibration_slope_max)
    if precision == "fp32":
        cands["fp32"] = {
            "status": "not_applicable",
            "reason": "the raw candidate already runs in fp32",
        }
    else:
        preds["fp32"] = run_path(Calibration("fp32", "fp32"))
        cands["fp32"] = _judge("fp32", preds["fp32"], rows, cfg, skill=False)
    preds["per_sample"] = run_path(Calibration("per_sample", precision))
    cands["per_sample"] = _judge("per_sample", preds["per_sample"], rows, cfg, skill=False)

    cause = _cause(preds, cands, rows.label_std, precision)
    chosen = next((c for c in cfg.order if cands[c]["status"] == "passed"), None)
    report = {
        "status": "passed" if chosen else "failed",
        "chosen": chosen,
        "why": _why(chosen, cfg.order, cands),
        "order": list(cfg.order),
        "precision": precision,
        "n_rows": int(len(idx)),
        "thresholds": {
            k: getattr(cfg, k)
            for k in (
                "median_ratio_min",
                "p10_ratio_min",
                "flat_tolerance",
                "max_flat_fraction",
                "broadcast_tolerance",
                "max_broadcast_fraction",
                "min_correlation",
                "calibration_slope_max",
            )
        },
        "candidates": cands,
        "cause": cause,
        "chosen_metrics": cands[chosen]["metrics"] if chosen else None,
    }
    if chosen is None:
        return report, None
    affine = chosen == "calibrated"
    cal = Calibration(
        chosen,
        "fp32" if chosen == "fp32" else precision,
        slope if affine else None,
        intercept if affine else None,
    )
    return report, cal


def _slope_summary(slope: np.ndarray, slope_max: float) -> dict:
    s = slope.reshape(-1)
    return {
        "median": float(np.median(s)),
        "min": float(s.min()),
        "max": float(s.max()),
        "at_bound": float(np.mean((s <= 0) | (s >= slope_max))),
    }


def _cause(
    preds: Mapping[str, np.ndarray], cands: Mapping[str, dict], label_std: float, precision: str
) -> dict:
    """Which part of the path collapses, from the differences between candidates."""
    scale = max(label_std, 1e-12)
    bd = float(np.max(np.abs(preds["raw"] - preds["per_sample"]))) / scale
    cause: dict = {
        "batch_dependence": bd,
        "batch_dependent": bool(bd > BATCH_DEPENDENCE_TOL.get(precision, 1e-4)),
    }
    if "fp32" in preds:
        cause["precision_effect"] = float(np.max(np.abs(preds["raw"] - preds["fp32"]))) / scale
    status = {k: v["status"] for k, v in cands.items()}
    if status["raw"] == "passed":
        text = "no collapse: the raw predictions pass"
    elif cause["batch_dependent"] and status["per_sample"] == "passed":
        text = (
            f"batch-level broadcast: a row's output depends on the other rows of its batch (batched vs batch-size-1 outputs differ by {bd:.3g} x label std); "
            "the model mixes or broadcasts along the batch dimension"
        )
    elif status.get("fp32") == "passed":
        text = f"reduced precision: the {precision} run collapses and the fp32 re-run does not (tail quantization)"
    elif status.get("calibrated") == "passed":
        text = "under-dispersed outputs: the model ranks rows well but compresses their spread; a per-output affine restores it"
    else:
        text = "the model's predictions themselves collapsed (no candidate restores spread with skill); retrain or change the model"
    cause["diagnosis"] = text
    return cause


def _why(chosen: str | None, order, cands: Mapping[str, dict]) -> str:
    def reason(c: str) -> str:
        v = cands[c]
        return f"{c}: " + ("; ".join(v.get("reasons", [])) or v.get("reason", v["status"]))

    earlier = (
        [reason(c) for c in order[: list(order).index(chosen)]]
        if chosen
        else [reason(c) for c in order]
    )
    if chosen is None:
        return "every candidate collapsed: " + " | ".join(earlier)
    head = f"{chosen} is the first candidate in collapse.order that passes"
    return head + (" (" + " | ".join(earlier) + ")" if earlier else "")


# ---------------------------------------------------------------- files and the stage


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_calibration(directory: Path, cal: Calibration, extra: Mapping) -> None:
    """calibration.json (+ slope.npy / intercept.npy for an affine) into `directory`."""
    affine = None
    if cal.slope is not None:
        np.save(
            directory / "slope.npy", np.asarray(cal.slope, dtype=np.float32), allow_pickle=False
        )
        np.save(
            directory / "intercept.npy",
            np.asarray(cal.intercept, dtype=np.float32),
            allow_pickle=False,
        )
        affine = {"slope_file": "slope.npy", "intercept_file": "intercept.npy"}
    write_json(
        directory / CALIBRATION_FILE,
        {"candidate": cal.candidate, "precision": cal.precision, "affine": affine, **extra},
    )


def load_calibration(directory: str | Path) -> tuple[Calibration, dict]:
    """(Calibration, calibration.json) of a collapse-check output; refuses a failed check."""
    d = Path(directory)
    if (d / FAILED_MARKER).exists():
        raise CollapseError(
            f"{d / FAILED_MARKER}: collapse-check found every candidate collapsed (see {d / REPORT_FILE}); "
            "fix or retrain the model and re-run collapse-check"
        )
    path = d / CALIBRATION_FILE
    if not path.is_file():
        raise StaleOutputError(f"{path} not found; run collapse-check first")
    meta = json.loads(path.read_text())
    if meta.get("candidate") not in CANDIDATES:
        raise StaleOutputError(
            f"{path}: candidate {meta.get('candidate')!r} is not one of {CANDIDATES}; re-run collapse-check"
        )
    slope = intercept = None
    if meta.get("affine"):
        slope = np.load(d / meta["affine"]["slope_file"], allow_pickle=False)
        intercept = np.load(d / meta["affine"]["intercept_file"], allow_pickle=False)
    return Calibration(meta["candidate"], meta.get("precision", "fp32"), slope, intercept), meta


def check_model_matches(meta: Mapping, model_path: Path, where: str) -> None:
    """Refuse a calibration made for another model file."""
    want = meta.get("model_sha256")
    if want and want != file_sha256(model_path):
        raise StaleOutputError(
            f"{where} was made for another {model_path.name} than {model_path}; re-run collapse-check"
        )


def flat_metrics(report: Mapping) -> dict[str, float]:
    """Numbers for `dvc metrics show` and MLflow: pass/fail, each candidate's measures, the choice."""
    out = {"collapse/passed": float(report["status"] == "passed")}
    keys = (
        "spread_median",
        "spread_p10",
        "flat_fraction",
        "broadcast_fraction",
        "correlation_median",
        "mae",
        "distance",
    )
    for name, c in report["candidates"].items():
        vals = {**c.get("measures", {}), "distance": c.get("distance")}
        for key in keys:
            v = vals.get(key)
            if v is not None and math.isfinite(v):
                out[f"collapse/{name}/{key}"] = float(v)
    for k, v in (report.get("chosen_metrics") or {}).items():
        if math.isfinite(v):
            out[f"collapse/chosen/{k}"] = float(v)
    return out


def run(cfg, ctx, *, staged: Path, trained: Path) -> dict:
    """The collapse-check stage; raises CollapseError (after writing the report) when all collapse."""
    ds, model, ckpt = load_staged(staged, trained, ctx.stage)
    device, dev_reason = select_device(cfg.runtime.device)
    model.to(device)
    precision, prec_reason = run_precision(cfg.collapse.precision, ckpt)
    val = np.asarray(ds.split("val"))
    if len(val) > cfg.collapse.max_rows:  # the per-sample candidate runs one row at a time
        val = np.sort(np.random.default_rng(0).choice(val, cfg.collapse.max_rows, replace=False))
    if len(val) < 2:
        raise StaleOutputError(
            f"splits/val.npy has {len(val)} rows; collapse-check needs >= 2: re-run stage-data with a larger data.val_fraction"
        )
    manifest = ds.manifest
    rows = CheckRows(
        features=np.asarray(ds.features[val], dtype=np.float32),
        target=np.asarray(ds.labels[val]),
        naive=naive_predictions(ds, val),
        label_std=float(
            np.std(np.asarray(ds.labels[np.asarray(ds.split("train"))], dtype=np.float64))
        ),
        axes=tuple(manifest.get("label_axes") or ()),
        axis_values=manifest.get("label_axis_values") or {},
    )
    report, cal = check_candidates(model, rows, cfg.collapse, precision, device)
    model_path = trained / "model.pt"
    ident = {"model_sha256": file_sha256(model_path), "data_fingerprint": ds.fingerprint}
    report.update(ident, precision_reason=prec_reason, device=f"{device} ({dev_reason})")
    metrics = flat_metrics(report)
    with atomic_dir(ctx.output()) as tmp:
        write_json(tmp / REPORT_FILE, report)
        write_json(tmp / "metrics.json", metrics)
        if cal is None:
            (tmp / FAILED_MARKER).write_text(report["why"] + "\n")
        else:
            write_calibration(tmp, cal, ident)
    write_json(Path(ctx.run_dir) / REPORT_FILE, report)  # also beside the run's logs
    out = ctx.output()
    ctx.events.artifact(out / REPORT_FILE)
    ctx.events.param("collapse/chosen", report["chosen"] or "none")
    ctx.events.metrics(metrics)
    if cal is None:
        ctx.events.event("collapse", why=report["why"], diagnosis=report["cause"]["diagnosis"])
        raise CollapseError(
            f"collapse-check: {report['why']}; diagnosis: {report['cause']['diagnosis']}; report: {out / REPORT_FILE}"
        )
    ctx.logger.info("collapse-check chose %s: %s", report["chosen"], report["why"])
    return {
        "chosen": report["chosen"],
        "report": str(out / REPORT_FILE),
        "calibration": str(out / CALIBRATION_FILE),
        "why": report["why"],
    }
