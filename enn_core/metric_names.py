"""Metric and parameter names: docs/metrics.md's table, in code.

One style everywhere (MLflow runs, the DVC metrics files under `outputs/metrics/`, the
validation baselines, the champion rule):

- a metric is `group/name` (lower case, `_` inside a name; a split's results are
  `val/mae`, `test/r2`; a per-epoch curve is `epoch/val_loss`);
- a parameter is the dotted key of `params.yaml` (`train.lr`); what a stage decided at run
  time (a device, a world size, a checkpoint folder) is `resolved.<section>.<key>`;
- telemetry (where the time and memory went) lives under `telemetry/`, after the loss curves
  (`epoch/`, `step/`) in MLflow's alphabetical chart sections.

tests/unit/test_metric_names.py checks this module against docs/metrics.md, and the e2e tier
checks every name a real run logs against the same table.
"""

from __future__ import annotations

from collections.abc import Mapping

TELEMETRY = "telemetry/"
RESOLVED = "resolved."
SPLITS: tuple[str, ...] = ("val", "test")
# The naive predictors validate scores: per key and cell (mean, median), per cell (mean,
# median). `naive_best` names the one with the lowest validation MAE (enn_core.metrics).
NAIVE: tuple[str, ...] = (
    "naive_conditional",
    "naive_conditional_median",
    "naive_cell_mean",
    "naive_cell_median",
)
NAIVE_BEST = "naive_best"
# The fitted baselines validate scores beside them (validate.baselines).
BASELINES: tuple[str, ...] = ("ridge", "gbt")

# The validation metric the champion rule and the early stopping compare (lower is better).
PROMOTION_METRIC = "val/mae"
# The naive predictor a model must beat to be promoted: the best for MAE on the validation
# rows (its name: the validate run's `resolved.validate.naive_best`, the version's tags);
# reports written before the medians have only the conditional mean (LEGACY_PROMOTION_BASELINE).
PROMOTION_BASELINE = "val/naive_best_mae"
LEGACY_PROMOTION_BASELINE = "val/naive_conditional_mae"

# What the parent run shows beside the parameters (Compare lines these up): per split.
HEADLINE: tuple[str, ...] = (
    "mae",
    "rmse",
    "r2",
    "naive_conditional_mae",
    "naive_cell_mean_mae",
    "naive_conditional_median_mae",
    "naive_cell_median_mae",
    "naive_best_mae",
    "skill_vs_naive_conditional",
    "skill_vs_naive_cell_mean",
    "skill_vs_naive_best",
    "ridge_mae",
    "gbt_mae",
    "skill_vs_ridge",
    "skill_vs_gbt",
)

# What dvc.yaml declares as metrics, per stage (few and short, so that `dvc metrics show` and
# `dvc exp show --only-changed` fit a 120-column terminal beside a few changed parameters):
# validate's MAE on both splits, distributed-train's epochs run (early stopping shows there).
# The rest of each stage's numbers (the naive predictors, skill, R²...) stay in
# `outputs/<stage>/metrics.json`, MLflow and docs/metrics.md.
DVC_VALIDATE: tuple[str, ...] = ("val/mae", "test/mae")
DVC_TRAIN: tuple[str, ...] = ("train/epochs_run",)

# distributed-train's metrics file (`outputs/metrics/distributed-train.json`) and the parent
# run's training summary: record key -> metric name.
TRAIN_SUMMARY: Mapping[str, str] = {
    "epochs_run": "train/epochs_run",
    "best_epoch": "train/best_epoch",
    "applied_steps": "train/applied_steps",
    "train_loss": "train/final_train_loss",
    "val_loss": "train/best_val_loss",
    "samples_per_s": "train/samples_per_s",
    "restarts": "train/restarts",
    "world_size": "train/world_size",
}


def telemetry(name: str) -> str:
    """`telemetry/<name>`: a measurement of how the run went, not of the model."""
    return TELEMETRY + name


def resolved(name: str) -> str:
    """`resolved.<name>`: a value a stage chose at run time (MLflow parameter)."""
    return name if name.startswith(RESOLVED) else RESOLVED + name


def result(split: str, name: str) -> str:
    """`<split>/<name>`: a result on one split (`val/mae`)."""
    return f"{split}/{name}"


def headline(metrics: Mapping[str, float]) -> dict[str, float]:
    """The headline results among a validate stage's metrics, per split."""
    keys = {result(s, n) for s in SPLITS for n in HEADLINE}
    return {k: float(v) for k, v in metrics.items() if k in keys}


def train_summary(record: Mapping[str, object]) -> dict[str, float]:
    """distributed-train's numeric summary under the table's names (from the workers' record)."""
    out: dict[str, float] = {}
    for key, name in TRAIN_SUMMARY.items():
        value = record.get(key)
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)):
            out[name] = float(value)
    return out


def four(x: float) -> str:
    """A metric in 4 significant digits, trailing zeros kept (`2.000`, not `2`, which reads as
    an integer beside 2.111), a bare trailing point dropped (`1235`)."""
    return f"{x:#.4g}".removesuffix(".")
