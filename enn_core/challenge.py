"""The champion's challenge: two trained models scored on the same rows.

A retrain on refreshed data (more rows, other rows, the same columns) has another data
fingerprint than the champion; its validation MAE and the champion's, each measured on its
own data, do not compare. So the champion is scored on the candidate's validation rows,
through the same prediction path (its own calibration), and the two MAEs are compared there.

    schema_differences(candidate.data, champion.data)   # [] when the same task
    score = score_split(champion_folder, staged, "val")   # Score(mae, rows, skipped)

The schema is what makes two models the same task: the features (names, order, kinds, cyclic
periods), the label shape and its axes. Vocabularies may differ (refreshed data meets a new
category, or the same categories first appear in another order): the candidate's codes are
mapped to the champion's by their spelling, and rows holding a category the champion never
saw are left out of its score (counted in `skipped`). No category in common is a clash.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from enn_core.checkpoint import DataSpec
from enn_core.data.dataset import StagedDataset
from enn_core.errors import DataError
from enn_core.predict.schema import remap_codes
from enn_core.serving import TableModel

ERROR_CHUNK_ROWS = 65536  # rows predicted and compared at once (24 labels: 12 MB of float64)


class SchemaClash(DataError):
    """The two models do not predict the same task (other features or labels)."""


@dataclass(frozen=True)
class Score:
    """A model's MAE (real units) on the rows of one split it could read."""

    mae: float
    rows: int  # rows scored
    skipped: int  # rows holding a category the model never saw


def schema(data: DataSpec) -> dict[str, Any]:
    """What two models must share to be compared (vocabularies apart)."""
    return {
        "features": [
            [s.get("name"), s.get("kind"), s.get("cyclic_period")] for s in data.feature_specs
        ],
        "label_shape": list(data.label_shape),
        "label_axes": list(data.label_axes),
    }


def schema_differences(ours: DataSpec, theirs: DataSpec) -> list[str]:
    """What differs between two models' schemas, in words ([] when the same task)."""
    a, b = schema(ours), schema(theirs)
    out = []
    names_a = [f[0] for f in a["features"]]
    names_b = [f[0] for f in b["features"]]
    if names_a != names_b:
        out.append(f"features {names_a} vs {names_b}")
    else:
        for fa, fb in zip(a["features"], b["features"], strict=True):
            if fa != fb:
                out.append(f"feature {fa[0]!r} is {fa[1]} vs {fb[1]}")
    if a["label_shape"] != b["label_shape"]:
        out.append(f"label shape {a['label_shape']} vs {b['label_shape']}")
    elif a["label_axes"] != b["label_axes"]:
        out.append(f"label axes {a['label_axes']} vs {b['label_axes']}")
    return out


def score_split(folder: str | Path, staged: str | Path, split: str = "val") -> Score:
    """The MAE of the model in `folder` (model.pt + calibration.json) on `split` of the staged
    dataset, through its chosen prediction path; SchemaClash when it is another task."""
    s = split_errors(folder, staged, split)
    return Score(mae=s.mae, rows=len(s.kept), skipped=int(len(s.rows) - len(s.kept)))


def row_errors(pred: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Each row's absolute error, the mean over its label cells (missing targets left out)."""
    return _row_mean(
        np.abs(np.asarray(pred, dtype=np.float64) - np.asarray(target, dtype=np.float64))
    )


def _row_mean(diff: np.ndarray) -> np.ndarray:
    flat = diff.reshape(len(diff), -1)
    with np.errstate(invalid="ignore"):
        return np.nanmean(flat, axis=1) if flat.shape[1] else np.zeros(len(diff))


@dataclass(frozen=True)
class SplitErrors:
    """A model's errors on a split: its rows (sorted), the positions among them the model could
    read, each of those rows' absolute error (`row_errors`) and the MAE over every cell."""

    rows: np.ndarray
    kept: np.ndarray
    errors: np.ndarray
    mae: float


def split_errors(
    folder: str | Path, staged: str | Path, split: str = "val", chunk_rows: int = ERROR_CHUNK_ROWS
) -> SplitErrors:
    """The model in `folder` on `split`: predicted, and compared with the targets, a chunk of
    `chunk_rows` rows at a time (a float64 a row is what it keeps: the predictions and targets
    of 1.5 x 10^6 validation rows at once, with their differences, were over a GB)."""
    model = TableModel.load(folder)
    ds = StagedDataset(staged)
    data = ds.manifest.data_spec()
    clash = schema_differences(data, model.checkpoint.data)
    if clash:
        raise SchemaClash(f"{Path(folder)} predicts another task: {'; '.join(clash)}")
    rows = np.sort(np.asarray(ds.split(split)))
    x, ok = remap_codes(np.asarray(ds.features[rows]), data.feature_specs, model.specs)
    if not ok.any():
        raise SchemaClash(
            f"{Path(folder)} knows none of the categories of the {split} rows of {ds.path}"
        )
    kept = np.flatnonzero(ok)
    from enn_core.inference import predict_rows

    errors = np.empty(len(kept))
    total, cells = 0.0, 0
    for a in range(0, len(kept), chunk_rows):
        part = kept[a : a + chunk_rows]
        pred = predict_rows(model.path, x, part, 256)
        diff = np.abs(pred.astype(np.float64) - np.asarray(ds.targets[rows[part]], np.float64))
        total, cells = total + float(diff.sum()), cells + diff.size
        errors[a : a + len(part)] = _row_mean(diff)
    return SplitErrors(rows, kept, errors, total / cells if cells else float("nan"))
