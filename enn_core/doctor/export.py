"""Doctor, export layer: the configured model's prediction path (PredictionPath: raw features
in, real units out) through torch.export with a dynamic batch, and its parity with eager at
batch sizes 1 and the sample size, within export.parity_rel_tol. Skipped by --quick (the
first torch.export in a process costs several seconds). A failure names the operator or
constraint, in the export stage's words (enn_core.export.explain_failure). The ONNX line says
whether its dependencies are importable; the export stage itself runs the ONNX parity.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.export import Dim

from enn_core.doctor.context import DoctorContext
from enn_core.doctor.report import Check, Recorder
from enn_core.errors import EnnError


def run(ctx: DoctorContext) -> list[Check]:
    rec = Recorder("export")
    if ctx.quick:
        rec.add("torch.export", "skip", "skipped by --quick (several seconds)")
    else:
        try:
            model = ctx.model()
        except EnnError as e:
            rec.add(
                "torch.export", "skip", f"no model to export (model build failed: {str(e)[:120]})"
            )
        else:
            from enn_core.inference import PredictionPath

            manifest, rows, _, source = ctx.sample()
            label_std = float(manifest.label_stats.std or 1.0)
            path = PredictionPath(model.cpu().eval())
            export_parity(rec, path, rows, label_std, ctx.cfg.export.parity_rel_tol, source)
    onnx_deps(rec, ctx)
    return rec.checks


def export_parity(
    rec: Recorder,
    module: torch.nn.Module,
    rows: np.ndarray,
    label_std: float,
    rel_tol: float,
    source: str = "sample",
) -> None:
    """torch.export `module` with a dynamic batch; parity with eager at batch 1 and len(rows)."""
    from enn_core.export import explain_failure

    x = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
    example = x if len(x) >= 2 else x.repeat(2, 1)  # a batch of 1 would be specialized
    with rec.timer() as t:
        try:
            ep = torch.export.export(
                module, (example,), dynamic_shapes={"x": {0: Dim("batch", min=1)}}
            )
            exported = ep.module()
            worst, sizes = 0.0, sorted({1, len(x)})
            with torch.inference_mode():
                ref_max = float(module(x).abs().max())
                for size in sizes:
                    got, want = exported(x[:size]), module(x[:size])
                    worst = max(worst, float((got - want).abs().max()))
        except Exception as e:  # noqa: BLE001 - every tracer failure becomes one named line
            rec.add(
                "torch.export",
                "fail",
                explain_failure("torch_export", e),
                "make the prediction path export-safe (the message names the operator or line)",
                t(),
            )
            return
        secs = t()
    tol = rel_tol * max(ref_max, label_std)
    detail = (
        f"dynamic batch exported in {secs:.1f} s from {source}; "
        f"parity max |diff| {worst:.3g} at batch "
        f"sizes {sizes} (tolerance {tol:.3g})"
    )
    if worst > tol:
        rec.add(
            "torch.export",
            "fail",
            detail,
            "an operator behaves differently exported: make the path export-safe",
            secs,
            worst=worst,
        )
    else:
        rec.add("torch.export", "ok", detail, seconds=secs, worst=worst, tolerance=tol)


def onnx_deps(rec: Recorder, ctx: DoctorContext) -> None:
    from enn_core.export import missing_dependencies

    if "onnx" not in ctx.cfg.export.formats:
        rec.add("onnx", "skip", "onnx not in export.formats")
        return
    missing = missing_dependencies("onnx")
    required = "onnx" in ctx.cfg.export.required
    if not missing:
        rec.add(
            "onnx",
            "ok",
            f"onnx, onnxscript and onnxruntime importable (opset {ctx.cfg.export.opset}); "
            "the export stage checks ONNX parity",
        )
    elif required:
        rec.add(
            "onnx",
            "fail",
            f"required format onnx needs {missing}, not installed",
            f"pip install -c constraints.txt {' '.join(missing)}, "
            "or remove onnx from export.required",
        )
    else:
        rec.add(
            "onnx",
            "warn",
            f"optional format onnx will be skipped: {missing} not installed",
            f"pip install -c constraints.txt {' '.join(missing)}",
        )
