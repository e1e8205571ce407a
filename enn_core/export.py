"""export stage: the chosen prediction path as deployable artifacts, with parity checked.

Exports `PredictionPath(model, calibration)` (encoding, normalization and calibration
included: raw feature vector in, real units out) chosen by collapse-check:

- `torch_export` -> `model.pt2` (torch.export, dynamic batch dimension);
- `onnx` -> `model.onnx` (dynamo exporter from the same ExportedProgram, dynamic batch),
  run under onnxruntime for parity.

Parity is part of every export: on a fixed, seeded sample of at most `export.parity_rows`
held-out rows (validation + test; all of them when there are fewer), at each of
`export.parity_batch_sizes` (batches filled by cycling the rows, so every batch has exactly
that size), the exported program and the ONNX model agree with the eager path within
max |diff| <= export.parity_rel_tol x max(max |reference|, label std), or the export fails.

A format in `export.required` that fails fails the stage; a format not required is skipped
only when its dependency is missing, and says so. A failure names the format, the operator
or dynamic-shape constraint that broke, and what to change. A per-sample candidate (the model
is batch-dependent) is refused: it cannot be exported with a dynamic batch.

Autocast is not part of an exported graph: the path is exported in fp32 and compared with the
eager path in fp32 (the sidecar says so when the run's candidate used bf16/fp16).

Outputs (`outputs/export/`, replaced atomically; untouched on failure): `model.pt2`,
`model.onnx`, `sidecar.json`, `parity.json`, `metrics.json`. Run: `enn export`.
"""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import math
import platform
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import torch
from torch.export import Dim, ExportedProgram

from enn_core import export_cache
from enn_core.atomic import atomic_dir, write_json
from enn_core.collapse.report import read_report
from enn_core.config import ExportConfig, RunConfig
from enn_core.errors import ExportError
from enn_core.inference import (
    CALIBRATION_FILE,
    MODEL_FILE,
    Calibration,
    PredictionPath,
    check_model_matches,
    label_std,
    load_calibration,
    load_trained,
    sha256_file,
)
from enn_core.model_code import ModelCode
from enn_core.onnx_program import (
    INPUT_NAME,
    ONNX_DATA,
    OUTPUT_NAME,
    Runner,
    name_batch_axis,
    onnx_files,
    ort_runner,
)
from enn_core.stage import StageContext
from enn_core.summaries import ExportSummary

if TYPE_CHECKING:
    from enn_core.data.dataset import StagedDataset
    from enn_core.inference import Checkpoint

SIDECAR_VERSION = 1
PARITY_SEED = 0  # the held-out rows parity runs on are the same in every run of the same data
FILES = {"torch_export": "model.pt2", "onnx": "model.onnx"}
# Python modules each format needs at export and parity time.
DEPENDENCIES: dict[str, tuple[str, ...]] = {
    "torch_export": (),
    "onnx": ("onnx", "onnxscript", "onnxruntime"),
}


class Parity(TypedDict):
    """One format's parity (`parity.json`): max |exported - eager| per batch size, the worst,
    the tolerance, whether it holds, the rows compared and the held-out rows they were drawn
    from."""

    max_abs_diff: dict[str, float]
    worst: float
    tolerance: float
    ok: bool
    rows: int
    heldout_rows: int


def missing_dependencies(fmt: str) -> list[str]:
    return [m for m in DEPENDENCIES[fmt] if importlib.util.find_spec(m) is None]


def refuse_batch_dependent(cal: Calibration, bd: float | None = None) -> None:
    """A per-sample candidate means the batched model is wrong: no dynamic-batch artifact
    (`bd`: the report's batch dependence, batched vs batch-size-1 outputs / label std)."""
    if cal.candidate != "per_sample":
        return
    detail = (
        f" (batched vs batch-size-1 outputs differ by {bd:.3g} x label std)"
        if bd is not None
        else ""
    )
    raise ExportError(
        "export: collapse-check chose the per_sample candidate because the model is "
        f"batch-dependent{detail}: a row's output depends on the other rows of its batch, so no "
        "dynamic-batch export can be correct; fix the batch-level broadcast in the model (no "
        "reductions or broadcasts across dim 0), retrain and re-run collapse-check"
    )


# ---------------------------------------------------------------- failure messages


def explain_failure(fmt: str, exc: BaseException) -> str:
    """One line: the format, the operator or constraint that broke, and what to change."""
    text = str(exc)
    chain = f"{text} {exc.__cause__ or ''}"
    m = re.search(
        r"No ONNX function found for <OpOverload\(op='([^']+)', overload='([^']+)'\)>", chain
    ) or re.search(r"target=torch\.ops\.([\w.]+?)\.(\w+)\]?\(", chain)
    if fmt == "onnx" and m:
        op = f"{m.group(1)}.{m.group(2)}"
        return (
            f"export onnx: operator {op} has no ONNX translation at opset; replace it with "
            "standard torch operators in the model's prediction path, or register a translation "
            "(torch.onnx.export custom_translation_table)"
        )
    m = re.search(
        r"Constraints violated \((\w+)\)!.*?specialized it to be a constant \((\d+)\)", text, re.S
    )
    if m:
        return (
            f"export {fmt}: dynamic-shape constraint on dimension '{m.group(1)}' broke: the "
            f"prediction path fixes the batch size to {m.group(2)} (a reshape/view or expand with "
            "a literal batch size, or a shape check); use x.shape[0] or -1 for the batch dimension"
        )
    m = re.search(r"Could not guard on data-dependent expression (.+?)\s+\(", text)
    if m or "data-dependent" in text:
        where = re.search(r'File "([^"]+)", line (\d+), in (\w+)\n\s+(.+)', text)
        loc = (
            f" at {Path(where.group(1)).name}:{where.group(2)} ({where.group(4).strip()})"
            if where
            else ""
        )
        return (
            f"export {fmt}: data-dependent control flow{loc}: Python branches on tensor values "
            "cannot be exported; use torch.where (or torch.cond) instead of `if` on a tensor"
        )
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    return (
        f"export {fmt}: {type(exc).__name__}: {first[:300]}; see the run's logs for the trace and "
        "make the prediction path export-safe"
    )


# ---------------------------------------------------------------- export + parity


def parity_sample(heldout: np.ndarray, limit: int, seed: int = PARITY_SEED) -> np.ndarray:
    """At most `limit` of the held-out row indices `heldout` (sorted), drawn uniformly without
    replacement with a fixed seed (so spread over validation and test in proportion), sorted;
    all of them when there are no more than `limit`."""
    heldout = np.asarray(heldout)
    if len(heldout) <= limit:
        return heldout
    pick = np.random.default_rng(seed).choice(len(heldout), size=limit, replace=False)
    return heldout[np.sort(pick)]


def _batches(rows: int, size: int) -> list[np.ndarray]:
    """Row indices cycled so that every batch has exactly `size` rows and every row is used."""
    n_batches = max(1, math.ceil(rows / size))
    order = np.arange(n_batches * size) % rows
    return [order[i * size : (i + 1) * size] for i in range(n_batches)]


def reference(eager: torch.nn.Module, x: np.ndarray, batch: int = 64) -> np.ndarray:
    """The eager path's outputs on every row of `x`, batch by batch (float32): computed once,
    the reference of every format at every batch size (a row's output does not depend on its
    batch: collapse-check refuses a batch-dependent model, and refuse_batch_dependent here)."""
    out: list[np.ndarray] = []
    with torch.inference_mode():
        for i in range(0, len(x), batch):
            xb = torch.from_numpy(np.ascontiguousarray(x[i : i + batch], dtype=np.float32))
            out.append(eager(xb).float().numpy())
    return np.concatenate(out)


def check_parity(
    run: Runner,
    ref: np.ndarray,
    x: np.ndarray,
    batch_sizes: Sequence[int],
    tol: float,
    heldout_rows: int | None = None,
) -> Parity:
    """max |exported - eager| at each batch size over all rows of `x` (`ref`: the eager
    outputs of those rows, `reference`; `heldout_rows`: the held-out rows `x` was drawn from,
    default all of `x`)."""
    per_size: dict[str, float] = {}
    for size in batch_sizes:
        worst = 0.0
        for idx in _batches(len(x), size):
            xb = np.ascontiguousarray(x[idx], dtype=np.float32)
            got = np.asarray(run(xb))
            want = ref[idx]
            if got.shape != want.shape:
                raise ExportError(
                    f"parity: batch of {size} gave output shape {got.shape}, eager gives "
                    f"{want.shape}; the batch dimension is not dynamic"
                )
            worst = max(worst, float(np.max(np.abs(got.astype(np.float64) - want))))
        per_size[str(size)] = worst
    worst = max(per_size.values())
    return {
        "max_abs_diff": per_size,
        "worst": worst,
        "tolerance": tol,
        "ok": bool(worst <= tol),
        "rows": int(len(x)),
        "heldout_rows": int(len(x) if heldout_rows is None else heldout_rows),
    }


def interrupted(e: BaseException) -> BaseException:
    """`e`, unless a Ctrl-C is behind it: Python wraps a KeyboardInterrupt raised while a class
    is made (`RuntimeError: Error calling __set_name__ ...`, as the tracer's first import can
    be) in another error, which must stop the stage as interrupted, not fail the export."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            raise KeyboardInterrupt from e
        seen = seen.__cause__ or seen.__context__
    return e


def export_torch(path: PredictionPath, example: torch.Tensor) -> ExportedProgram:
    try:
        return torch.export.export(path, (example,), dynamic_shapes={"x": {0: Dim("batch", min=1)}})
    except Exception as e:  # any tracer failure becomes one actionable line
        raise ExportError(explain_failure("torch_export", interrupted(e))) from e


def export_onnx(
    ep: ExportedProgram, example: torch.Tensor, target: Path, opset: int, external_mb: float
) -> None:
    """`target` (model.onnx), its weights in ONNX_DATA beside it when they pass `external_mb`
    MB (a protobuf file cannot hold 2 GB; every copy of model.onnx carries the file along)."""
    try:
        prog = torch.onnx.export(
            ep,
            (example,),
            dynamo=True,
            verbose=False,  # else it prints "[torch.onnx] Run decompositions..." to stdout
            opset_version=opset,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
        )
        assert prog is not None  # the dynamo exporter returns its program (None: legacy only)
        weights = sum(
            v.const_value.nbytes
            for v in prog.model.graph.initializers.values()
            if v.const_value is not None
        )
        prog.save(str(target), external_data=weights > external_mb * 2**20)
    except Exception as e:
        raise ExportError(explain_failure("onnx", interrupted(e))) from e
    name_batch_axis(target)


def export_all(
    path: PredictionPath,
    heldout: np.ndarray,
    out_dir: Path,
    cfg: ExportConfig,
    label_std: float,
    say: Callable[[str], None] | None = None,
    heldout_rows: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Export each configured format into `out_dir` and check its parity on the rows of
    `heldout` (`cfg`: export section; `heldout_rows`: the held-out rows they were sampled from,
    `parity_sample`, default all of them); `say` gets a line as each part starts (each takes
    seconds)."""
    say = say or (lambda line: None)
    if path.per_sample:
        refuse_batch_dependent(Calibration("per_sample"))
    path = path.eval()
    x = np.asarray(heldout, dtype=np.float32)
    if len(x) == 0:
        raise ExportError(
            "export: no held-out rows for the parity check; re-run stage-data with non-empty "
            "val/test splits"
        )
    total = len(x) if heldout_rows is None else heldout_rows
    example = torch.from_numpy(x[np.arange(cfg.example_batch) % len(x)])
    results: dict[str, dict[str, Any]] = {}
    # (program, eager outputs, max |reference|, tolerance): made once, at the first format
    # not skipped
    exported: tuple[ExportedProgram, np.ndarray, float, float] | None = None
    for fmt in cfg.formats:
        missing = missing_dependencies(fmt)
        if missing:
            if fmt in cfg.required:
                raise ExportError(
                    f"export {fmt}: required format needs {missing} which are not installed; "
                    f"install them (pip install -c constraints.txt {' '.join(missing)}) or remove "
                    f"{fmt} from export.required"
                )
            results[fmt] = {
                "status": "skipped",
                "reason": f"optional format; missing dependency {missing}",
            }
            continue
        if exported is None:  # every format starts from the same ExportedProgram
            say("tracing the prediction path (torch.export, dynamic batch)")
            ep = export_torch(path, example)
            ref = reference(path, x, max(cfg.parity_batch_sizes))
            ref_max = float(np.max(np.abs(ref)))
            exported = (ep, ref, ref_max, cfg.parity_rel_tol * max(ref_max, label_std))
        ep, ref, ref_max, tol = exported
        target = out_dir / FILES[fmt]
        sizes = ", ".join(str(b) for b in cfg.parity_batch_sizes)
        say(
            f"{FILES[fmt]}: writing it, then parity on {len(x):,} of {total:,} held-out rows "
            f"at batch {sizes}"
        )
        if fmt == "torch_export":
            torch.export.save(ep, str(target))
            run = _program_runner(target)
        else:
            export_onnx(ep, example, target, cfg.opset, cfg.onnx_external_data_mb)
            run = ort_runner(target)
        parity = check_parity(run, ref, x, cfg.parity_batch_sizes, tol, total)
        if not parity["ok"]:
            raise ExportError(
                f"export {fmt}: parity failed: max |diff| {parity['worst']:.3g} > {tol:.3g} "
                f"(export.parity_rel_tol={cfg.parity_rel_tol} x max(max |reference| "
                f"{ref_max:.4g}, label std {label_std:.4g})) at batch sizes "
                f"{parity['max_abs_diff']}; an operator behaves differently exported: make the "
                "path export-safe"
            )
        results[fmt] = {
            "status": "ok",
            "file": FILES[fmt],
            "sha256": sha256_file(target),
            "parity": parity,
        }
        if fmt == "onnx" and len(onnx_files(target)) > 1:  # its weights, beside it
            data = target.with_name(ONNX_DATA)
            results[fmt]["external_data"] = {"file": ONNX_DATA, "sha256": sha256_file(data)}
        # the loaded-back program (or onnxruntime's session) holds a copy of the weights: let
        # it go before the next format makes its own (504M: the stage held 4.2 GB, 2x)
        del run
        gc.collect()
    return results


def _program_runner(target: Path) -> Runner:
    """The saved torch.export program at `target`, loaded back."""
    module = torch.export.load(str(target)).module()
    return lambda xb: module(torch.from_numpy(xb)).detach().numpy()


# ---------------------------------------------------------------- sidecar and the stage


def versions() -> dict[str, str]:
    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
    }
    for dist in ("onnx", "onnxscript", "onnxruntime", "enn-pipeline"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def build_sidecar(
    data: Mapping[str, Any],
    cal: Calibration,
    cfg: ExportConfig,
    results: Mapping[str, Mapping[str, Any]],
    ident: Mapping[str, object],
    exported_precision: str,
) -> dict[str, Any]:
    """What a user needs to call the artifacts: inputs, outputs, units, opset, versions,
    provenance."""
    specs = list(data.get("feature_specs") or [])
    label_shape = list(data.get("label_shape") or [])
    axes = list(data.get("label_axes") or [])
    return {
        "format_version": SIDECAR_VERSION,
        "input": {
            "name": INPUT_NAME,
            "dtype": "float32",
            "shape": ["batch", len(specs)],
            "encoding": "raw feature vector: continuous as the value, categorical as the "
            "integer code into its vocab, cyclic as the raw periodic value",
            "features": [{"index": i, **dict(s)} for i, s in enumerate(specs)],
            "order": [s.get("name") for s in specs],
        },
        "output": {
            "name": OUTPUT_NAME,
            "dtype": "float32",
            "shape": ["batch", *label_shape],
            "axes": [
                "batch",
                *(
                    axes
                    if len(axes) == len(label_shape)
                    else [f"dim{i}" for i in range(len(label_shape))]
                ),
            ],
            "axis_values": dict(data.get("label_axis_values") or {}),
            "units": cfg.units or "label units (real, denormalized)",
        },
        "dynamic_axes": {"input": {"0": "batch"}, "output": {"0": "batch"}},
        "candidate": cal.candidate,
        "calibration": "per-output affine included" if cal.slope is not None else "none",
        "precision": exported_precision,
        "precision_note": ""
        if cal.precision == exported_precision
        else f"the chosen candidate ran under {cal.precision} autocast; autocast is not "
        "exported, the graph runs in fp32",
        "formats": {
            k: {kk: vv for kk, vv in v.items() if kk != "parity"} for k, v in results.items()
        },
        "opset": cfg.opset,
        "versions": versions(),
        **dict(ident),
    }


@dataclass(frozen=True)
class Inputs:
    """What export reads: the staged data, the trained checkpoint, the chosen calibration, the
    prediction path they make (fp32), the held-out rows parity runs on (`parity_sample`) and
    how many held-out rows there are."""

    ds: StagedDataset
    ckpt: Checkpoint
    cal: Calibration
    path: PredictionPath
    heldout: np.ndarray
    std: float
    model_path: Path
    heldout_rows: int


def prediction_inputs(
    cfg: RunConfig, root: Path, stage: str, staged: Path, trained: Path, calibration: Path
) -> Inputs:
    """The export's inputs, checked."""
    code = ModelCode.of(cfg.model, root)
    ds, model, ckpt = load_trained(staged, trained, stage, code)
    cal, cal_meta = load_calibration(calibration)
    report = read_report(calibration)
    refuse_batch_dependent(cal, report.cause.batch_dependence if report else None)
    model_path = trained / MODEL_FILE
    check_model_matches(cal_meta, model_path, str(calibration / CALIBRATION_FILE))
    exported = replace(cal, precision="fp32")  # autocast is not part of an exported graph
    path = PredictionPath(model.float(), exported).eval()
    heldout_rows = np.sort(
        np.concatenate([np.asarray(ds.split("val")), np.asarray(ds.split("test"))])
    )
    sample = parity_sample(heldout_rows, cfg.export.parity_rows)
    heldout = np.asarray(ds.features[sample], dtype=np.float32)
    return Inputs(ds, ckpt, cal, path, heldout, label_std(ds), model_path, len(heldout_rows))


def run(
    cfg: RunConfig, ctx: StageContext, *, staged: Path, trained: Path, calibration: Path
) -> ExportSummary:
    """The export stage; raises ExportError (writing nothing into its output) on failure."""
    inputs = prediction_inputs(cfg, ctx.layout.root, ctx.stage, staged, trained, calibration)
    ds, ckpt, cal, heldout = inputs.ds, inputs.ckpt, inputs.cal, inputs.heldout
    say: Callable[[str], None] = lambda line: ctx.logger.info("%s: %s", ctx.stage, line)  # noqa: E731
    ident = {
        "data_fingerprint": ds.fingerprint,
        "model_sha256": sha256_file(inputs.model_path),
        "heldout_rows": inputs.heldout_rows,
        "parity_rows": int(len(heldout)),
    }
    cache: Path | None = None
    if cfg.model.preset != "custom":  # a custom model's code is not in the key
        key = export_cache.key(cfg.export, ident, calibration / CALIBRATION_FILE, versions())
        cache = ctx.layout.work / "cache" / ctx.stage / key
    with atomic_dir(ctx.output()) as tmp:
        results = export_cache.load(cache, tmp) if cache is not None else None
        if results is not None:
            ctx.logger.info(
                "%s: the programs and parity of this checkpoint, calibration, data and settings "
                "are in %s: copied, not made again",
                ctx.stage,
                cache,
            )
        else:
            try:
                results = export_all(
                    inputs.path, heldout, tmp, cfg.export, inputs.std, say, inputs.heldout_rows
                )
            except ExportError as e:
                write_json(Path(ctx.run_dir) / "export-failure.json", {"error": str(e)})
                ctx.events.event("export_failed", error=str(e))
                raise
            if cache is not None:
                export_cache.store(cache, tmp, results)
        parity = {
            k: v.get("parity", {"status": v["status"], "reason": v.get("reason")})
            for k, v in results.items()
        }
        metrics: dict[str, float] = {
            f"parity/{k}/max_abs_diff": v["worst"] for k, v in parity.items() if "worst" in v
        }
        metrics.update(
            {f"parity/{k}/tolerance": v["tolerance"] for k, v in parity.items() if "tolerance" in v}
        )
        write_json(tmp / "parity.json", parity)
        write_json(tmp / "metrics.json", metrics)
        write_json(
            tmp / "sidecar.json",
            build_sidecar(ckpt.data.as_dict(), cal, cfg.export, results, ident, "fp32"),
        )
    out = ctx.output()
    ctx.events.metrics(metrics)
    # the stage's run logs sidecar.json and parity.json (EXPORT.artifacts); the programs go to
    # the store once, in the registered model's bundle: logged here too they doubled a version's
    # bytes in the store (4 GB more for a 504M model; docs/serving.md, the disk a version takes)
    for k, v in results.items():
        if v["status"] == "skipped":
            ctx.logger.warning("export %s skipped: %s", k, v["reason"])
    return ExportSummary(
        output=str(out),
        formats={k: v["status"] for k, v in results.items()},
        sidecar=str(out / "sidecar.json"),
        parity={k: v.get("worst") for k, v in parity.items()},
    )
