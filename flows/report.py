"""What `enn` says about a stage and a run, besides its log lines: a stage's `--help` (what it
reads and writes, from its spec), the closing summary's results and predictions lines, and
what running a stopped command again does. flows/summary.py and flows/cli.py print them."""

from __future__ import annotations

import argparse
import json
import re
import textwrap

from enn_core.metric_names import NAIVE, NAIVE_BEST, four
from enn_core.paths import Layout
from enn_core.stages import COLLAPSE_CHECK, DISTRIBUTED_TRAIN, StageSpec


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


METRIC_NAME = re.compile(r"[a-z][a-z0-9_]{0,40}")
RESULTS_WIDTH = 120  # a 120-column terminal: the summary's lines never wrap there


def results_line(m: dict[str, object]) -> str | None:
    """`results: val MAE ...; test MAE ...` in at most RESULTS_WIDTH characters: when every
    predictor is named it would be longer, the test split names only those that beat the model,
    then validation too, then the first three that beat it and how many more (MLflow and `dvc
    metrics show` hold every figure)."""
    for val, test in ((None, None), (None, 0), (0, 0), (3, 3), (1, 1)):
        parts = [results_part(m, "val", val), results_part(m, "test", test)]
        line = "results: " + "; ".join(p for p in parts if p)
        if len(line) <= RESULTS_WIDTH:
            return line if any(parts) else None
    return line[: RESULTS_WIDTH - 3] + "..."


def results_part(m: dict[str, object], split: str, most: int | None = None) -> str:
    """`val MAE 3.334, beaten by gbt 3.286 (naive_conditional 3.5, ridge 3.4)`: the model's MAE
    on `split`, every predictor validate scored that beat it, else the best naive predictor (the
    one chosen on the validation rows, `naive_best` in metrics.json) and each fitted baseline;
    each by its metric's name (`val/<name>_mae`, docs/metrics.md). They are reported, not a
    gate here: docs/design.md."""
    model = m.get(f"{split}/mae")
    if not isinstance(model, (int, float)):
        return ""
    prefix, found = f"{split}/", {}
    for key, value in m.items():
        name = key.removeprefix(prefix).removesuffix("_mae")
        # a metric's name, as validate writes them (metrics.json is a file: nothing else prints)
        if key.startswith(prefix) and key.endswith("_mae") and METRIC_NAME.fullmatch(name):
            if isinstance(value, (int, float)) and name != NAIVE_BEST:
                found[name] = float(value)
    best = m.get(NAIVE_BEST)
    naive = [n for n in NAIVE if n in found]
    if not isinstance(best, str) or best not in found:
        best = min(naive, key=lambda n: found[n]) if naive else None
    shown = [best] if best else []
    shown += sorted(n for n in found if n not in NAIVE)  # the fitted baselines: gbt, ridge
    beat = sorted((n for n in found if found[n] <= model), key=lambda n: found[n])
    rest = [n for n in shown if n not in beat]
    head = f"{split} MAE {four(model)}"
    if most is not None:  # shortened: the first `most` (0: all) that beat it, how many more
        most = most or len(beat)
        more = f" (+{len(beat) - most})" if len(beat) > most else ""
        named = ", ".join(f"{n} {four(found[n])}" for n in beat[:most])
        return head + (f", beaten by {named}{more}" if beat else "")
    if beat:
        head += f", beaten by {', '.join(f'{n} {four(found[n])}' for n in beat)}"
    return head + (f" ({', '.join(f'{n} {four(found[n])}' for n in rest)})" if rest else "")


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


def stopped(head: str, args: argparse.Namespace) -> str:
    """`interrupted; run the same command again ...`: what ended the command and what running
    it again does, wrapped at words within RESULTS_WIDTH (later lines indented)."""
    return textwrap.fill(
        head + again(args),
        width=RESULTS_WIDTH,
        subsequent_indent="  ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def again(args: argparse.Namespace) -> str:
    """What running a stopped command again does, exactly (nothing to add for the servers,
    which Ctrl-C is the way to stop). A run on the pipeline's params.yaml: DVC skips the stages
    that finished (dvc.lock records each); a --config run, or one with a path outside the
    project, is its own (DVC neither skips nor records it): every stage runs again. Training
    continues from its last checkpoint only when it was stopped mid-training with the same
    fingerprint (data, data/model/train settings, torch); a finished training starts over."""
    if args.command == "tune":
        return "; run the same command again to resume the study"
    training = (
        "distributed-train continues from its last checkpoint if it was stopped mid-training "
        "with the same data, model and train settings, else trains from epoch 1"
    )
    if args.command == DISTRIBUTED_TRAIN.name:
        return (
            "; run the same command again to resume: it continues from its last checkpoint "
            "with the same data, model and train settings, else trains from epoch 1"
        )
    if args.command != "run":
        return ""
    if one_off(args):
        return (
            "; the same command runs every stage again (DVC neither skips nor records a "
            f"{one_off(args)} run); {training}"
        )
    return f"; run the same command again to resume: DVC skips the stages that finished; {training}"


def one_off(args: argparse.Namespace) -> str:
    """Why DVC neither skips nor records this `enn run` ("--config", "--set path outside the
    project"), or ""."""
    from pathlib import Path

    from enn_core.paths import pipeline_params
    from flows.params_file import is_pipeline_params, plan

    flow = getattr(args, "flow", None) or "training"
    given = getattr(args, "config", None)
    config = Path(given).resolve() if given else pipeline_params(flow)
    if not is_pipeline_params(config):
        return "--config"
    try:
        if plan(config, list(getattr(args, "overrides", None) or [])).one_off():
            return "--set path outside the project"
    except Exception:  # noqa: BLE001 - an unreadable override: the run said so already
        return ""
    return ""
