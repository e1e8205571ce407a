"""What `enn` says about a stage and a run, besides its log lines: a stage's `--help` (what it
reads and writes, from its spec), the closing summary's results and predictions lines, and
what running a stopped command again does. flows/summary.py and flows/cli.py print them."""

from __future__ import annotations

import argparse
import json

from enn_core.paths import Layout
from enn_core.stages import COLLAPSE_CHECK, TRAINING, StageSpec


def reads_writes(spec: StageSpec, where: str = "") -> str:
    """`reads: ...; writes: ...` of one stage, from its spec (paths under its pipeline,
    `where`: "" or "prediction/")."""
    section = "section" if len(spec.sections) == 1 else "sections"
    reads = [f"{where}params.yaml ({section} {', '.join(spec.sections)})"] if spec.sections else []
    reads += [", ".join(f"{where}outputs/{s.name}/" for s in spec.inputs)] if spec.inputs else []
    reads += [f"{where}outputs/{s.name}/ when there" for s in spec.optional_inputs]
    reads += [f"{key}, a checkpoint or models:/NAME@ALIAS" for key in spec.model_refs]
    writes = f"{where}outputs/{spec.name}/ ({', '.join(spec.outputs)})"
    if spec.metrics:
        writes += f"; {where}outputs/metrics/{spec.name}.json (dvc metrics)"
    return f"reads: {'; '.join(reads) or 'nothing'}\nwrites: {writes}"


def stage_description(spec: StageSpec, variant: StageSpec | None) -> str:
    """`enn <stage> --help`: what the stage does, reads and writes (its spec: one definition),
    and its prediction pipeline's version when it has one."""
    text = f"{spec.help}\n\n{reads_writes(spec)}"
    if variant is not None:
        text += f"\n\n--pipeline prediction: {variant.help}\n" + reads_writes(
            variant, "prediction/"
        )
    return text


# validate's baselines, as the results line names them and in its order (any other
# `<split>/<name>_mae` by its name, after these)
BASELINE_LABELS = {
    "naive_conditional": "conditional naive",
    "naive_cell_mean": "per-cell mean",
    "ridge": "ridge",
    "gbt": "gbt",
}


def results_part(m: dict[str, float], split: str) -> str:
    """`val MAE 3.334, beaten by gbt 3.286 (conditional naive 3.5, per-cell mean 6.3, ridge
    3.4)`: the model's MAE on `split`, each baseline validate scored, and which of them beat
    the model (they are reported, not a gate: docs/design.md)."""
    model = m.get(f"{split}/mae")
    if not isinstance(model, (int, float)):
        return ""
    prefix, found = f"{split}/", {}
    for key, value in m.items():
        name = key.removeprefix(prefix).removesuffix("_mae")
        if key.startswith(prefix) and key.endswith("_mae") and name and "/" not in name:
            if isinstance(value, (int, float)):
                found[name] = float(value)
    order = [n for n in BASELINE_LABELS if n in found] + sorted(set(found) - set(BASELINE_LABELS))
    baselines = [(BASELINE_LABELS.get(n, n), found[n]) for n in order]
    beat = [f"{n} {v:.4g}" for n, v in baselines if v < model]
    rest = [f"{n} {v:.4g}" for n, v in baselines if v >= model]
    head = f"{split} MAE {model:.4g}" + (f", beaten by {', '.join(beat)}" if beat else "")
    return head + (f" ({', '.join(rest)})" if rest else "")


def predictions_lines(layout: Layout) -> list[str]:
    """Where the prediction flow's released predictions are (collapse-check's output)."""
    out = COLLAPSE_CHECK.output_dir(layout)
    manifest = out / "manifest.json"
    if not manifest.is_file():
        return []
    meta = json.loads(manifest.read_text())
    files = [
        f
        for f in ("predictions.parquet", "predictions.npy", "predictions.xlsx")
        if (out / f).is_file()
    ]
    if not files:
        return []
    also = f"; {', '.join(files[1:])} beside it" if files[1:] else ""
    n = meta.get("n_rows", "?")
    return [f"predictions: {out / files[0]} ({n} row{'' if n == 1 else 's'}{also})"]


def again(args: argparse.Namespace) -> str:
    """What running a stopped command again does (nothing to add for the servers, which
    Ctrl-C is the way to stop)."""
    if args.command == "tune":
        return "; run the same command again to resume the study"
    if args.command == "run" or args.command in {s.name for s in TRAINING}:
        return (
            "; run the same command again to resume: stages that finished are skipped, "
            "distributed-train continues from its last checkpoint"
        )
    return ""
