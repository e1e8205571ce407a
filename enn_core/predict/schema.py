"""Check a dataset's features against the model's data spec before predicting.

The model (its checkpoint's `data.feature_specs`) fixes the feature names, their order, their
kinds and, for categorical features, their vocabularies. A staged dataset (features-only or a
training split) must agree on all of these, and every categorical code must fall inside the
model's vocabulary: a category the model never saw is an error naming the feature, the value
and the first row holding it. Every failure is one line that says what to do.

Vocabularies grow in order of first appearance, so two trainings of one task may code the same
categories differently. New inputs are staged against the latest training manifest, which
need not be the chosen model's (a retrain that was not promoted): `remap_file` rewrites their
codes into the model's vocabulary by spelling (`remap_codes`), so the model reads each row as
its source spells it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from enn_core.data.manifest import DataSpec, StagedManifest
from enn_core.errors import DataError

# A feature spec as the manifest and the checkpoint store it (JSON: name, kind, vocab, ...).
Spec = Mapping[str, Any]
# The staged data's manifest and the model's data spec; a mapping is their JSON form.
Data = StagedManifest | Mapping[str, Any]
Model = DataSpec | Mapping[str, Any]


def _field(record: Data | Model, key: str) -> Any:
    """A field of a manifest or a data spec (None where it has none), or a mapping's key."""
    return record.get(key) if isinstance(record, Mapping) else getattr(record, key, None)


def check_specs(
    data_specs: Sequence[Spec],
    model_specs: Sequence[Spec],
    where: str,
    *,
    vocabularies: bool = True,
) -> None:
    """Names, order, kinds, cyclic periods and (`vocabularies`) vocabularies must agree.

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
        if vocabularies and m.get("kind") == "categorical" and not codes_agree(d, m):
            dv, mv = list(d.get("vocab") or []), list(m.get("vocab") or [])
            diff = next(  # the first code that differs
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


def needs_remap(data_specs: Sequence[Spec], model_specs: Sequence[Spec]) -> bool:
    """Whether a categorical vocabulary of the data codes its values otherwise than the model's
    (not the same values at the same codes, the data's possibly extended by more)."""
    return any(
        m.get("kind") == "categorical" and d.get("kind") == "categorical" and not codes_agree(d, m)
        for d, m in zip(data_specs, model_specs, strict=False)
    )


def codes_agree(data: Spec, model: Spec) -> bool:
    """Whether the data's categorical vocabulary codes the model's values as the model does:
    the same values at the same codes, possibly followed by more (caught per row)."""
    mv = list(model.get("vocab") or [])
    return list(data.get("vocab") or [])[: len(mv)] == mv


def remap_codes(
    features: np.ndarray, ours: Sequence[Spec], theirs: Sequence[Spec]
) -> tuple[np.ndarray, np.ndarray]:
    """(features with categorical codes mapped from our vocabularies to theirs, mask of the
    rows whose every category they know)."""
    x = np.array(features, dtype=np.float32, copy=True)
    ok = np.ones(len(x), dtype=bool)
    for j, (mine, other) in enumerate(zip(ours, theirs, strict=True)):
        if mine.get("kind") != "categorical":
            continue
        index = {v: i for i, v in enumerate(other.get("vocab") or [])}
        table = np.array([index.get(v, -1) for v in mine.get("vocab") or []], dtype=np.int64)
        codes = table[x[:, j].astype(np.int64)]
        ok &= codes >= 0
        x[:, j] = np.where(codes >= 0, codes, 0)
    return x, ok


def remap_file(
    src: Path,
    dest: Path,
    data_specs: Sequence[Spec],
    model_specs: Sequence[Spec],
    where: str,
    chunk_rows: int = 1 << 16,
) -> Path:
    """The features in `src` ([N, F], coded by `data_specs`) written to `dest` coded by the
    model's vocabularies; a category the model never saw is one line naming the row, the
    feature and the category."""
    features = np.load(src, mmap_mode="r")
    check_codes(features, data_specs, where)  # every code names a category of the data
    tmp = dest.with_name(f".{dest.name}.tmp")
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=features.shape)
    try:
        for r0 in range(0, features.shape[0], chunk_rows):
            block = np.asarray(features[r0 : r0 + chunk_rows])
            x, ok = remap_codes(block, data_specs, model_specs)
            if not ok.all():
                i = int(np.flatnonzero(~ok)[0])
                unseen = _first_unseen(block[i], data_specs, model_specs)
                raise DataError(f"{where}: row {r0 + i}, {unseen}")
            out[r0 : r0 + len(x)] = x
        out.flush()
    except BaseException:
        del out
        tmp.unlink(missing_ok=True)
        raise
    del out
    tmp.replace(dest)
    return dest


def _first_unseen(row: np.ndarray, data_specs: Sequence[Spec], model_specs: Sequence[Spec]) -> str:
    for j, (d, m) in enumerate(zip(data_specs, model_specs, strict=True)):
        if m.get("kind") != "categorical":
            continue
        value = list(d.get("vocab") or [])[int(row[j])]
        known = list(m.get("vocab") or [])
        if value not in known:
            return (
                f"feature '{m['name']}': category {value!r} was not seen in training (the "
                f"model knows {len(known)} values); drop those rows or retrain with them"
            )
    raise AssertionError("remap_codes found a row with an unseen category, and none is")


def check_labels(manifest: Data, model_data: Model, where: str) -> None:
    """The model must predict the labels of the data's task: a features-only dataset carries
    the label shape of the training data it was staged against."""
    want = list(_field(manifest, "label_shape") or [])
    have = list(_field(model_data, "label_shape") or [])
    if want and have and want != have:
        against = _field(manifest, "training_manifest") or "its training data"
        raise DataError(
            f"{where}: the model predicts labels of shape {have} but this task's are {want} "
            f"(staged against {against}): it is a model of another task; predict with this "
            "task's model (--model champion) or stage the input against the model's training "
            "manifest"
        )


def check_schema(
    manifest: Data,
    features: np.ndarray,
    model_data: Model,
    where: str,
    *,
    remapped: bool = False,
) -> None:
    """The whole check: specs first, then the codes of every row. `remapped`: `features` are
    already coded by the model's vocabularies (`remap_file`), so only those are checked."""
    data_specs = list(_field(manifest, "feature_specs") or [])
    model_specs = list(_field(model_data, "feature_specs") or [])
    check_specs(data_specs, model_specs, where, vocabularies=not remapped)
    if features.ndim != 2 or features.shape[1] != len(model_specs):
        raise DataError(
            f"{where}: features have shape {list(features.shape)} but the model expects "
            f"[N, {len(model_specs)}]; re-stage the input"
        )
    check_codes(features, model_specs, where, None if remapped else data_specs)
