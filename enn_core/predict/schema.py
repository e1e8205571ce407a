"""Check a dataset's features against the model's data spec before predicting.

The model (its checkpoint's `data.feature_specs`) fixes the feature names, their order, their
kinds and, for categorical features, their vocabularies. A staged dataset (features-only or a
training split) must agree on all of these, and every categorical code must fall inside the
model's vocabulary: a category the model never saw is an error naming the feature, the value
and the first row holding it. Every failure is one line that says what to do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from enn_core.errors import DataError

# A feature spec as the manifest and the checkpoint store it (JSON: name, kind, vocab, ...).
Spec = Mapping[str, Any]


def check_specs(data_specs: Sequence[Spec], model_specs: Sequence[Spec], where: str) -> None:
    """Names, order, kinds, cyclic periods and vocabularies of the features must agree.

    A dataset vocabulary that extends the model's (same prefix, more values) passes here; its
    extra codes are caught per row by `check_codes`.
    """
    names = [s["name"] for s in data_specs]
    want = [s["name"] for s in model_specs]
    if names != want:
        if sorted(names) == sorted(want):
            raise DataError(
                f"{where}: features are {names} but the model expects the order {want}; "
                "re-stage the input"
            )
        missing = [n for n in want if n not in names]
        extra = [n for n in names if n not in want]
        raise DataError(
            f"{where}: features {names} do not match the model's {want} (missing {missing}, "
            f"unexpected {extra}); stage the input against the model's training manifest"
        )
    for d, m in zip(data_specs, model_specs, strict=True):
        name = m["name"]
        if d.get("kind") != m.get("kind"):
            raise DataError(
                f"{where}: feature '{name}' is {d.get('kind')} but the model expects "
                f"{m.get('kind')}; re-stage the input"
            )
        if d.get("cyclic_period") != m.get("cyclic_period"):
            raise DataError(
                f"{where}: feature '{name}' has cyclic period {d.get('cyclic_period')} but the "
                f"model expects {m.get('cyclic_period')}; re-stage the input"
            )
        if m.get("kind") == "categorical":
            dv, mv = list(d.get("vocab") or []), list(m.get("vocab") or [])
            if dv[: len(mv)] != mv:
                diff = next(
                    (i for i, (a, b) in enumerate(zip(dv, mv, strict=False)) if a != b),
                    min(len(dv), len(mv)),
                )
                raise DataError(
                    f"{where}: feature '{name}' vocabulary differs from the model's at code "
                    f"{diff} ({_at(dv, diff)!r} vs {_at(mv, diff)!r}); stage the input against "
                    "the model's training manifest"
                )


def _at(seq: Sequence[object], i: int) -> object:
    return seq[i] if i < len(seq) else "<none>"


def check_codes(
    features: np.ndarray,
    model_specs: Sequence[Spec],
    where: str,
    data_specs: Sequence[Spec] | None = None,
    chunk_rows: int = 1 << 16,
) -> None:
    """Every categorical value must be an integer code inside the model's vocabulary."""
    cats = [(j, s) for j, s in enumerate(model_specs) if s.get("kind") == "categorical"]
    if not cats:
        return
    cols = [j for j, _ in cats]
    for r0 in range(0, features.shape[0], chunk_rows):
        block = np.asarray(features[r0 : r0 + chunk_rows, cols])
        for c, (j, spec) in enumerate(cats):
            v = block[:, c]
            n = len(spec.get("vocab") or [])
            bad = np.flatnonzero(~np.isfinite(v) | (v != np.round(v)) | (v < 0) | (v >= n))
            if len(bad):
                row = r0 + int(bad[0])
                raise DataError(
                    f"{where}: row {row}, feature '{spec['name']}': "
                    f"{_unseen(v[bad[0]], spec, data_specs, j)}"
                )


def _unseen(value: float, spec: Spec, data_specs: Sequence[Spec] | None, j: int) -> str:
    vocab = list(spec.get("vocab") or [])
    if np.isfinite(value) and value == int(value) and value >= 0 and data_specs is not None:
        dvocab = list(data_specs[j].get("vocab") or [])
        if int(value) < len(dvocab):
            return (
                f"category {dvocab[int(value)]!r} was not seen in training (the model knows "
                f"{len(vocab)} values); drop those rows or retrain with them"
            )
    return (
        f"code {value!r} is outside the model's vocabulary of {len(vocab)} values; "
        "re-stage the input against the model's training manifest"
    )


def check_schema(
    manifest: Mapping[str, Any], features: np.ndarray, model_data: Mapping[str, Any], where: str
) -> None:
    """The whole check: specs first, then the codes of every row."""
    data_specs = manifest.get("feature_specs") or []
    model_specs = model_data.get("feature_specs") or []
    check_specs(data_specs, model_specs, where)
    if features.ndim != 2 or features.shape[1] != len(model_specs):
        raise DataError(
            f"{where}: features have shape {list(features.shape)} but the model expects "
            f"[N, {len(model_specs)}]; re-stage the input"
        )
    check_codes(features, model_specs, where, data_specs)
