"""validate stage: the trained model's metrics on the validation and test splits, in real units.

Reads the staged data and the consolidated checkpoint (`model.pt` of distributed-train);
writes `metrics.json` (flat `"<split>/<metric>": number`, which `dvc metrics show` and the
MLflow child run both show) and `breakdown.json` (per label-axis value, e.g. per hour and per
section, and the flags in words) into its output folder.

The naive predictors of `enn_core.baselines` (per key and cell, per cell; means and medians)
are scored on the same rows (enn_core.metrics), every predictor a chunk of rows at a time
(memory does not grow with the rows beyond a statistic per column, docs/design.md); a flag
says, in words, which one the model does not beat, and is logged and written as an event.
The best of them for MAE on the validation rows is `naive_best` (`<split>/naive_best_mae`,
`<split>/skill_vs_naive_best`); its name is in `metrics.json` (`"naive_best"`, the one
string there), the run's parameter `resolved.validate.naive_best` and the console's skill
line. The fitted baselines of `enn_core.fitted_baselines` (ridge regression, gradient-boosted
trees; `validate.baselines`) are scored the same way and reported, not flagged: a table of
every predictor (the Prefect table `validate-baselines`, the log) and `breakdown.json`'s
`baselines` say how each was fitted.

The model runs its plain `predict` in fp32 (collapse-check compares precisions and paths).
Run: `enn validate`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from enn_core.atomic import atomic_dir, write_json
from enn_core.config import RunConfig
from enn_core.errors import DataError
from enn_core.fitted_baselines import BaselineResult, fitted_baselines
from enn_core.inference import load_trained, predict_rows, resolve_device
from enn_core.metric_names import NAIVE, NAIVE_BEST, four
from enn_core.metrics import (
    NAIVE_HOW,
    AxisBreakdown,
    NaiveModel,
    SplitScore,
    finite_or_none,
    one_warning,
    with_best_naive,
)
from enn_core.model_code import ModelCode
from enn_core.stage import StageContext
from enn_core.summaries import ValidateSummary

# a baseline's "fitting" line comes only when its fit is still running after this long: a fit of
# a fraction of a second (the Quick start's ridge and gbt) needs no line, a minute's does
SAY_FITTING_AFTER_S = 3.0

SPLITS: tuple[str, ...] = ("val", "test")
EVAL_CELLS = 1_000_000  # label numbers of a split scored at once (each predictor's, the targets)


def run(cfg: RunConfig, ctx: StageContext, *, staged: Path, trained: Path) -> ValidateSummary:
    """The validate stage: metrics.json + breakdown.json; returns the headline metrics."""
    code = ModelCode.of(cfg.model, ctx.layout.root)
    ds, model, _ = load_trained(staged, trained, ctx.stage, code)
    device, reason = resolve_device(cfg.runtime.device)
    model.to(device)
    ctx.events.param("validate.device", f"{device} ({reason})")
    manifest = ds.manifest
    axes = list(manifest.label_axes)
    axis_values = dict(manifest.label_axis_values)
    metrics: dict[str, float] = {}
    breakdown: dict[str, object] = {"label_axes": axes}
    per_split: dict[str, dict[str, AxisBreakdown]] = {}
    flags: list[str] = []
    fitted = fitted_baselines(
        ds,
        cfg.validate,
        SPLITS,
        ctx.layout.work / "cache" / "baselines",
        say=lambda line: ctx.logger.info("%s: %s", ctx.stage, line),
        bar_enabled=cfg.runtime.progress,
        say_after_s=SAY_FITTING_AFTER_S,
        chunk_rows=cfg.data.chunk_rows,
    )
    for name, res in fitted.items():
        ctx.events.param(f"validate.{name}", res.fit.detail)
        if not res.fit.cached:
            ctx.logger.info("%s: %s baseline: %s", ctx.stage, name, _how(res))
    naive = NaiveModel(ds, cfg.data.chunk_rows)
    shape = tuple(ds.targets.shape[1:])
    # rows scored at once: EVAL_CELLS label numbers, at most data.chunk_rows rows
    step = max(1, min(EVAL_CELLS // max(int(np.prod(shape)), 1), cfg.data.chunk_rows))
    for split in SPLITS:
        rows = np.asarray(ds.split(split))
        if len(rows) == 0:
            raise DataError(
                f"splits/{split}.npy is empty; re-run stage-data with a non-empty {split} split"
            )
        score = SplitScore(shape)
        tick = ctx.ticker(len(rows)).update  # a line now and then where no bar shows
        for a in range(0, len(rows), step):  # every predictor on a chunk of rows at a time
            part = rows[a : a + step]
            pred = predict_rows(
                model.predict, ds.features, part, cfg.predict.forward_rows, device, tick
            )
            baselines = {n: r.predictions[split][a : a + step] for n, r in fitted.items()}
            score.add(
                np.asarray(ds.targets[part]), {"model": pred, **naive.predict(part), **baselines}
            )
        m, b, f = score.result(split, axes, axis_values)
        metrics.update(m)
        per_split[split] = b
        flags.extend(f)
    metrics, best = with_best_naive(metrics, SPLITS)
    breakdown.update(splits=per_split, flags=flags, naive_best=best)
    breakdown["baselines"] = {name: fit_record(res) for name, res in fitted.items()}
    breakdown["data_fingerprint"] = ds.fingerprint
    with atomic_dir(ctx.output()) as tmp:
        named: dict[str, object] = {**finite_or_none(metrics)}
        if best is not None:
            named[NAIVE_BEST] = best
        write_json(tmp / "metrics.json", named)
        write_json(tmp / "breakdown.json", breakdown)
    for flag in flags:
        ctx.events.event("naive_not_beaten", message=flag)
    warning = one_warning(metrics, SPLITS)  # for every split (each split's flag is an event)
    if warning is not None:
        ctx.logger.warning("%s: %s", ctx.stage, warning)
    ctx.events.metrics({k: v for k, v in metrics.items() if math.isfinite(v)})
    table = comparison(metrics, fitted)
    ctx.events.table("baselines", table)
    # the console's lines: the model, the fitted baselines and the best naive predictor (every
    # naive predictor's MAE is in metrics.json, MLflow and the baselines table)
    shown = [row for row in table if row["predictor"] not in NAIVE or row["predictor"] == best]
    for split in SPLITS:
        maes = ", ".join(f"{row['predictor']} {four(_mae(row, split))}" for row in shown)
        ctx.logger.info("%s: %s MAE: %s", ctx.stage, split, maes)
    if best is not None:
        ctx.events.param(f"validate.{NAIVE_BEST}", best)
        ctx.logger.info("%s: %s", ctx.stage, skill_line(metrics, best))
    out = ctx.output()
    ctx.events.artifact(out / "metrics.json")
    ctx.events.artifact(out / "breakdown.json")
    return ValidateSummary(
        output=str(out),
        metrics_file=str(out / "metrics.json"),
        breakdown=str(out / "breakdown.json"),
        flags=tuple(flags),
        val_mae=metrics["val/mae"],
        test_mae=metrics["test/mae"],
        test_rmse=metrics["test/rmse"],
        test_r2=metrics["test/r2"],
    )


def skill_line(metrics: dict[str, float], best: str) -> str:
    """`skill against naive_conditional_median (the best naive on val rows): val 0.12, test
    0.081`, within 120 columns with its time and stage (each predictor: docs/metrics.md)."""
    skills = ", ".join(
        f"{split} {metrics[f'{split}/skill_vs_{NAIVE_BEST}']:.3g}"
        for split in SPLITS
        if f"{split}/skill_vs_{NAIVE_BEST}" in metrics
    )
    return f"skill against {best} (the best naive on val rows): {skills}"


def fit_record(res: BaselineResult) -> dict[str, object]:
    fit = res.fit
    return {
        "fit_s": round(fit.fit_s, 3),
        "samples": fit.samples,
        "available": fit.available,
        "subsampled": fit.subsampled,
        "detail": fit.detail,
        "cached": fit.cached,
    }


def _mae(row: dict[str, object], split: str) -> float:
    value = row[f"{split}_mae"]
    return float(value) if isinstance(value, (int, float)) else math.nan


def comparison(
    metrics: dict[str, float], fitted: dict[str, BaselineResult]
) -> list[dict[str, object]]:
    """One row per predictor (the model, the naive predictors, the fitted baselines): MAE on
    both splits, the model's skill against it, and how it was made."""
    names = [n for n in NAIVE if f"val/{n}_mae" in metrics] + list(fitted)
    rows: list[dict[str, object]] = [
        {
            "predictor": "model",
            "val_mae": metrics["val/mae"],
            "test_mae": metrics["test/mae"],
            "model_skill_val": None,
            "model_skill_test": None,
            "how": "this run",
        }
    ]
    for name in names:
        res = fitted.get(name)
        how = f"naive: {NAIVE_HOW.get(name, name)}" if res is None else _how(res)
        rows.append(
            {
                "predictor": name,
                "val_mae": metrics[f"val/{name}_mae"],
                "test_mae": metrics[f"test/{name}_mae"],
                "model_skill_val": _finite(metrics[f"val/skill_vs_{name}"]),
                "model_skill_test": _finite(metrics[f"test/skill_vs_{name}"]),
                "how": how,
            }
        )
    return rows


def _how(res: BaselineResult) -> str:
    fit = res.fit
    used = f"{fit.samples}/{fit.available} samples" if fit.subsampled else f"{fit.samples} samples"
    return f"{fit.detail}; {used}; {fit.fit_s:.1f} s" + (" (cached)" if fit.cached else "")


def _finite(v: float) -> float | None:
    return round(v, 4) if math.isfinite(v) else None
