"""Doctor, model layer: the configured model builds for the data, and a forward pass on a
sample gives finite, correctly shaped output (normalized and real units).

The sample is a few rows of the staged data, or of a small synthetic dataset when there is
none (the detail says which).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from enn_core.doctor.context import DoctorContext
from enn_core.doctor.report import Check, Recorder
from enn_core.errors import EnnError

if TYPE_CHECKING:
    from enn_core.model.enn import ENN


def run(ctx: DoctorContext) -> list[Check]:
    rec = Recorder("model")
    manifest, rows, _, source = ctx.sample()
    with rec.timer() as t:
        try:
            model = ctx.model()
        except EnnError as e:
            rec.add(
                "build",
                "fail",
                f"model.preset={ctx.cfg.model.preset} on {source}: {e}",
                "change the model section (the message names the field) or re-stage the data",
                t(),
            )
            return rec.checks
        secs = t()
    n_params = sum(p.numel() for p in model.parameters())
    rec.add(
        "build",
        "ok",
        f"{ctx.cfg.model.preset}: {n_params:,} parameters for features "
        f"{len(manifest.feature_specs)} -> labels {list(manifest.label_shape or ())} ({source})",
        seconds=secs,
        parameters=n_params,
        source=source,
    )
    forward(ctx, rec, model, rows, list(manifest.label_shape or ()), source)
    return rec.checks


def forward(
    ctx: DoctorContext,
    rec: Recorder,
    model: ENN,
    rows: np.ndarray,
    label_shape: list[int],
    source: str,
) -> None:
    x = torch.from_numpy(rows).to(ctx.device)
    model = model.to(ctx.device)
    with rec.timer() as t:
        try:
            with torch.no_grad():
                y = model(x)
                real = model.predict(x)
        except (RuntimeError, ValueError, IndexError) as e:
            first = str(e).splitlines()[0][:200]
            rec.add(
                "forward",
                "fail",
                f"forward on {len(rows)} rows of {source} raised {type(e).__name__}: {first}",
                "the features do not fit the model's encoder: "
                "re-stage the data or rebuild the checkpoint",
                t(),
            )
            return
        secs = t()
    want = [len(rows), *label_shape]
    bad = [
        name
        for name, out in (("normalized", y), ("real units", real))
        if not bool(torch.isfinite(out).all())
    ]
    if list(y.shape) != want or list(real.shape) != want:
        rec.add(
            "forward",
            "fail",
            f"output shape {list(y.shape)} (predict {list(real.shape)}), expected {want}",
            "the model's head does not match label_shape: rebuild the model for this data",
            secs,
        )
    elif bad:
        rec.add(
            "forward",
            "fail",
            f"non-finite {' and '.join(bad)} output on {len(rows)} rows of {source}",
            "check the label statistics in the manifest (std 0?) and the model.init_seed weights",
            secs,
        )
    else:
        rec.add(
            "forward",
            "ok",
            f"{len(rows)} rows of {source} -> {want} finite (normalized and real units) "
            f"on {ctx.device.type} in {secs * 1e3:.0f} ms",
            seconds=secs,
        )
