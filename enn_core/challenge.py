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
    rows, kept, pred, target = split_predictions(folder, staged, split)
    mae = float(np.mean(np.abs(pred.astype(np.float64) - target)))
    return Score(mae=mae, rows=len(kept), skipped=int(len(rows) - len(kept)))


def split_predictions(
    folder: str | Path, staged: str | Path, split: str = "val"
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(the split's rows, sorted; the positions among them the model could read; its
    predictions there; the targets there) of the model in `folder`."""
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

    pred = predict_rows(model.path, x, kept, 256)
    target = np.asarray(ds.targets[rows[kept]], dtype=np.float64)
    return rows, kept, pred, target
