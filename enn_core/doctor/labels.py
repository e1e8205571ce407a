"""Doctor, data layer, `labels`: a label that is mostly one value, found before a training run.

A label column that is one value on more than half of its training rows (a count that is zero
on most days) makes that value MAE's best constant: a model that predicts about it scores well
and collapse-check fails it on spread. The line says so, with the share, and points to
docs/your-data.md, "A label that is mostly one value". Read in chunks
(enn_core.data.label_mode); `--quick` reads a seeded sample of the training rows when their
labels are larger than QUICK_LABEL_BYTES.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from enn_core.data.label_mode import MOSTLY_ONE_VALUE, label_mode, output_name
from enn_core.doctor.context import DoctorContext
from enn_core.doctor.report import Recorder

if TYPE_CHECKING:
    from enn_core.data.dataset import StagedDataset

QUICK_LABEL_BYTES = 256 << 20  # --quick samples the training rows of larger labels down to this
SECTION = 'docs/your-data.md, "A label that is mostly one value"'


def labels(ctx: DoctorContext, rec: Recorder, ds: StagedDataset) -> None:
    """Warn when one value holds more than half of a label column's training rows."""
    if ds.labels is None:
        rec.add("labels", "skip", "features-only data: no labels to check")
        return
    train = np.asarray(ds.split("train")) if "train" in ds.split_names else np.arange(0)
    if not len(train):
        rec.add("labels", "skip", "no training rows: re-run `enn stage-data` with training rows")
        return
    row_bytes = max(1, ds.labels.itemsize * int(np.prod(ds.labels.shape[1:], dtype=np.int64)))
    rows, sampled = train, ""
    if ctx.quick and len(train) * row_bytes > QUICK_LABEL_BYTES:
        keep = QUICK_LABEL_BYTES // row_bytes
        rows = np.sort(np.random.default_rng(0).choice(train, keep, replace=False))
        sampled = f" (--quick: a sample of {keep:,})"
    with rec.timer() as t:
        mode = label_mode(ds.labels, rows, ctx.cfg.data.chunk_rows)
        secs = t()
    n_out = len(mode.shares)
    facts: dict[str, Any] = {
        "outputs": n_out,
        "mostly_one_value": mode.n_mostly,
        "rows": len(rows),
        "top_share": mode.top_share if mode.n_mostly else None,
        "top_value": mode.top_value if mode.n_mostly else None,
    }
    if not mode.n_mostly:
        rec.add(
            "labels",
            "ok",
            f"no value holds more than {MOSTLY_ONE_VALUE:.0%} of a label column "
            f"({n_out} outputs, {len(train):,} training rows{sampled})",
            seconds=secs,
            **facts,
        )
        return
    m = ds.manifest
    name = output_name(mode.top, m.label_shape or (), m.label_axes, m.label_axis_values)
    value = f"{mode.top_value:g}"
    several = f" ({mode.n_mostly} of {n_out} outputs are mostly one value)" if n_out > 1 else ""
    rec.add(
        "labels",
        "warn",
        f"{name}: {mode.top_share:.0%} of {len(train):,} training rows{sampled} are {value}"
        f"{several}: under MAE the best constant is about {value}, so a model near it scores "
        "well and collapse-check fails it on spread "
        f"(collapse.median_ratio_min={ctx.cfg.collapse.median_ratio_min:g})",
        f"read {SECTION}: which metric and loss fit such a label, and how to relax "
        "collapse.* knowingly",
        secs,
        **facts,
    )
