"""Evidence for a batch too small for the spread and broadcast statistics.

The prediction flow's collapse-check measures the spread of a batch of predictions across its
rows. Over a handful of rows that spread says nothing (three rows of one month vary little
whatever the model), so below `MIN_ROWS` the check judges with what a model carries:

1. its **reference batch**: training's collapse-check keeps the raw features of up to
   `REFERENCE_ROWS` validation rows (`reference.npy`, in the model's registered bundle); predict
   runs them in the same forward pass as the user's rows, so a collapsed model, or one that
   broadcasts one output across a batch, shows in the combined batch at any batch size;
2. else the **verdict stored with the model**: training's collapse-check report for this model
   (passed or held back);
3. always, at any number of rows: non-finite values and predictions far outside the range of the
   training targets (`range_measures`).

What was used is written into the report (`evidence`), so a verdict on three rows says on what
it rests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from enn_core.collapse.measures import Verdict, broadcast_measures, criteria, measure_predictions
from enn_core.collapse.report import REPORT_FILE, read_report
from enn_core.config import CollapseConfig
from enn_core.errors import StaleOutputError

REFERENCE_FILE = "reference.npy"  # training's collapse-check output: validation rows' features
BESIDE_FILE = "reference_predictions.npz"  # predict's output: the reference rows predicted
REFERENCE_ROWS = 64
MIN_ROWS = 32  # rows below which a batch's own spread and broadcast are not evidence
RANGE_CHUNK_CELLS = 2_000_000  # predicted numbers judged at once
RANGE_MARGIN = 1.0  # out of range: beyond the training targets' range by more than this x range


def write_reference(out_dir: Path, features: np.ndarray, seed: int = 0) -> Path:
    """Up to REFERENCE_ROWS rows of `features` (raw, coded by the model's vocabularies) as
    `out_dir/reference.npy`, a seeded sample in row order."""
    x = np.asarray(features, dtype=np.float32)
    if len(x) > REFERENCE_ROWS:
        keep = np.random.default_rng(seed).choice(len(x), REFERENCE_ROWS, replace=False)
        x = x[np.sort(keep)]
    path = Path(out_dir) / REFERENCE_FILE
    np.save(path, np.ascontiguousarray(x), allow_pickle=False)
    return path


@dataclass(frozen=True)
class Reference:
    """What a model's collapse-check output says about it: training's verdict, and the
    reference rows (None for a model registered before they were kept)."""

    directory: str
    verdict: str  # "passed" or "failed"
    why: str
    features: np.ndarray | None


def find_reference(dirs: list[Path], model_sha: str) -> Reference | None:
    """The first collapse-check output among `dirs` whose report names this model."""
    for d in dirs:
        if not (d / REPORT_FILE).is_file():
            continue
        report = read_report(d)
        if report is None or report.model_sha256 != model_sha:
            continue
        features = None
        if (d / REFERENCE_FILE).is_file():
            features = np.load(d / REFERENCE_FILE, allow_pickle=False)
            if features.ndim != 2:
                raise StaleOutputError(
                    f"{d / REFERENCE_FILE}: shape {list(features.shape)}, expected "
                    "[rows, features]; re-run collapse-check"
                )
        return Reference(str(d), report.status, report.why, features)
    return None


def predict_beside(
    predictor: torch.nn.Module,
    user: np.ndarray,
    reference: np.ndarray,
    device: torch.device | str = "cpu",
) -> dict[str, np.ndarray]:
    """The reference rows predicted in one forward pass with the user's rows (both coded by
    the model's vocabularies), and an input id for every row of [user rows, reference rows]
    (equal ids: equal inputs; what the broadcast measure compares)."""
    x = np.concatenate([np.asarray(user, np.float32), np.asarray(reference, np.float32)])
    if x.shape[1] != np.asarray(user).shape[1]:
        raise StaleOutputError(
            f"reference rows have {reference.shape[1]} features, the inputs "
            f"{user.shape[1]}; re-run collapse-check for this model"
        )
    with torch.no_grad():
        out = predictor(torch.as_tensor(x, device=device)).float().cpu().numpy()
    _, ids = np.unique(x.astype(np.float64), axis=0, return_inverse=True)
    return {"predictions": out[len(user) :], "input_ids": ids.reshape(-1).astype(np.int64)}


def range_measures(
    pred: np.ndarray, low: np.ndarray, high: np.ndarray, label_std: float
) -> dict[str, float]:
    """Non-finite values and values beyond the training targets' per-output range [low, high]
    by more than RANGE_MARGIN times that range (at least the label std): both hold for any
    number of rows."""
    width = np.maximum(high - low, label_std) * RANGE_MARGIN
    cells = int(np.prod(pred.shape[1:]))
    step = max(1, RANGE_CHUNK_CELLS // max(cells, 1))  # a memmap of 10^7 rows: in chunks
    non_finite, outside = 0, 0
    for a in range(0, len(pred), step):
        p = np.asarray(pred[a : a + step], dtype=np.float64).reshape(-1, cells)
        finite = np.isfinite(p)
        non_finite += int(p.size - np.count_nonzero(finite))
        outside += int(np.count_nonzero(finite & ((p < low - width) | (p > high + width))))
    size = len(pred) * cells
    return {
        "non_finite_fraction": non_finite / size if size else 0.0,
        "out_of_range_fraction": outside / size if size else 0.0,
    }


def target_range(
    labels: np.ndarray, chunk_rows: int | None = None, rows: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per-output minimum and maximum of [N, ...] targets, or of its rows `rows` (indices,
    sorted for a memmap), read in chunks (of RANGE_CHUNK_CELLS numbers unless `chunk_rows`)."""
    n = len(labels) if rows is None else len(rows)
    low = np.full(int(np.prod(labels.shape[1:])), np.inf)
    high = np.full_like(low, -np.inf)
    chunk_rows = chunk_rows or max(1, RANGE_CHUNK_CELLS // max(low.size, 1))
    for start in range(0, n, chunk_rows):
        at = slice(start, start + chunk_rows)
        chunk = labels[at] if rows is None else labels[rows[at]]
        part = np.asarray(chunk, np.float64).reshape(-1, low.size)
        low = np.minimum(low, np.nanmin(part, axis=0))
        high = np.maximum(high, np.nanmax(part, axis=0))
    return low, high


@dataclass(frozen=True)
class TrainingTargets:
    """What new predictions are judged against: the training targets' per-output spread and
    range, and the label std (tolerances are relative to it)."""

    spread: np.ndarray
    low: np.ndarray
    high: np.ndarray
    label_std: float


def judge_new(
    pred: np.ndarray,
    features: np.ndarray,
    targets: TrainingTargets,
    cfg: CollapseConfig,
    beside: Mapping[str, np.ndarray] | None,
    reference: Mapping[str, Any],
) -> Verdict:
    """The collapse verdict on new predictions with the evidence there is (module docstring):
    their own spread and broadcast from MIN_ROWS rows; below that, with the reference rows
    predicted beside them (`beside`, predict's reference_predictions.npz), else training's
    verdict on the model (`reference`, predict's manifest); ranges and non-finite values
    always. The verdict's `evidence` says which."""
    n = len(pred)
    reasons: list[str] = []
    if n >= MIN_ROWS:
        verdict = measure_predictions(
            pred, targets.spread, cfg, features=features, label_std=targets.label_std
        )
        measures, evidence = dict(verdict["measures"]), f"the {n} rows' own spread"
    elif beside is not None:
        both = np.concatenate([np.asarray(pred, np.float32), beside["predictions"]])
        ids = np.asarray(beside["input_ids"], np.float64).reshape(-1, 1)
        verdict = measure_predictions(
            both, targets.spread, cfg, features=ids, label_std=targets.label_std
        )
        k = len(beside["predictions"])
        measures = dict(verdict["measures"])
        evidence = (
            f"{n} row(s), fewer than the {MIN_ROWS} the spread needs: judged with the model's "
            f"{k} reference rows (validation rows of its training) predicted in the same batch"
        )
    else:
        tol = cfg.broadcast_tolerance * max(targets.label_std, 1e-12)
        measures = dict(broadcast_measures(features, pred, tol)) if n > 1 else {}
        stored = reference.get("verdict")
        if stored == "failed":
            reasons.append(
                f"training's collapse-check held this model back ({reference.get('why', '')})"
            )
        evidence = (
            f"{n} row(s), fewer than the {MIN_ROWS} the spread needs, and "
            + (
                f"the model carries no reference rows: training's verdict on it ({stored}), "
                if stored
                else "the model carries neither reference rows nor a verdict: "
            )
            + "ranges and non-finite values"
        )
    measures.update(range_measures(pred, targets.low, targets.high, targets.label_std))
    crit = criteria(measures, cfg, skill=False)
    reasons += [c.describe() for c in crit if not c.ok]
    measures["rows"] = float(n)
    return {
        "measures": measures,
        "criteria": [vars(c) for c in crit],
        "collapsed": bool(reasons),
        "reasons": reasons,
        "evidence": evidence,
    }
