"""The champion rule's test against the baselines: does a model beat a predictor on the
validation rows by more than chance?

    beats(model_errors, baseline_errors) -> Comparison

The rule (docs/serving.md): on at least `MIN_ROWS` validation rows, the paired
bootstrap (`RESAMPLES` resamples of the rows, fixed seed) of the mean difference of per-row
absolute errors (model minus predictor, each row's error the mean over its label cells) has
its upper `LEVEL` bound below zero: the model is better on these rows with 95% confidence,
not by the luck of which rows validation drew. The MAE alone decided before: a model
19 rows called better than the naive predictors was champion while gbt beat it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from enn_core.challenge import row_errors
from enn_core.metric_names import four

MIN_ROWS = 30
RESAMPLES = 2000
LEVEL = 0.95  # one-sided: the upper bound of the mean difference
SEED = 0
__all__ = ["RULE", "Comparison", "beats", "judge", "row_errors", "rule_text", "verdict"]
BLOCK_CELLS = 2**22  # row indices drawn at once (with what they pick: 64 MB), whatever the rows
# the whole rule, one line: the version tag `enn.champion_rule` (docs/serving.md says it too)
RULE = (
    "a version becomes champion when it beats the champion on its validation rows (the first "
    "has none to beat) and passes the rule (every naive predictor and fitted baseline beaten "
    f"by a paired bootstrap on at least {MIN_ROWS} validation rows), or the champion did not "
    "pass it either"
)


@dataclass(frozen=True)
class Comparison:
    """The model against one predictor on the same validation rows."""

    name: str
    model_mae: float
    mae: float  # the predictor's
    upper: float  # the upper LEVEL bound of mean(model error - predictor error)
    rows: int

    @property
    def beaten(self) -> bool:
        """The model beats it by the rule (enough rows, the whole interval below zero)."""
        return self.rows >= MIN_ROWS and self.upper < 0

    @property
    def beats_model(self) -> bool:
        """The predictor's MAE is at or below the model's (it beat the model, by any margin)."""
        return not self.model_mae < self.mae


def beats(name: str, model: np.ndarray, other: np.ndarray) -> Comparison:
    """The model's per-row errors `model` against a predictor's `other` on the same rows."""
    model, other = np.asarray(model, dtype=np.float64), np.asarray(other, dtype=np.float64)
    keep = np.isfinite(model) & np.isfinite(other)
    d = model[keep] - other[keep]
    n = len(d)
    if n == 0:
        return Comparison(name, float("nan"), float("nan"), float("inf"), 0)
    rng = np.random.default_rng(SEED)
    means = np.empty(RESAMPLES)
    # in blocks of at most 500 resamples and BLOCK_CELLS indices: 500 x 1.5 x 10^6 validation
    # rows were 12 GB at once (up to 8,388 rows the blocks, and so the draws, are as before)
    block = max(1, min(500, BLOCK_CELLS // n))
    for i in range(0, RESAMPLES, block):
        k = min(block, RESAMPLES - i)
        means[i : i + k] = d[rng.integers(0, n, size=(k, n))].mean(axis=1)
    upper = float(np.quantile(means, LEVEL))
    return Comparison(name, float(model[keep].mean()), float(other[keep].mean()), upper, n)


def judge(model: np.ndarray, others: Mapping[str, np.ndarray]) -> list[Comparison]:
    """The model against each predictor, in `others`' order."""
    return [beats(name, model, errors) for name, errors in others.items()]


def rule_text() -> str:
    """The rule in a few words, for the one line a terminal shows (docs/serving.md, "Which
    version is the champion", has it whole)."""
    return "the champion rule, a paired bootstrap: docs/serving.md"


def verdict(comparisons: list[Comparison]) -> tuple[bool, str]:
    """(the model beats every predictor by the rule, why in words with the numbers)."""
    if not comparisons:
        return True, "no baseline to beat"
    rows = comparisons[0].rows
    model = comparisons[0].model_mae
    beat = [c for c in comparisons if c.beats_model]
    if beat:
        names = ", ".join(f"{c.name} {four(c.mae)}" for c in beat)
        return False, f"val/mae {four(model)} is beaten by {names} on {rows} validation rows"
    if rows < MIN_ROWS:
        return False, (
            f"val/mae {four(model)} beats every baseline but on {rows} validation rows, fewer "
            f"than the {MIN_ROWS} the rule needs"
        )
    unsure = [c for c in comparisons if not c.beaten]
    if unsure:
        names = ", ".join(f"{c.name} {four(c.mae)} (bound {c.upper:+.3g})" for c in unsure)
        return False, (
            f"val/mae {four(model)} is not clearly below {names} on {rows} validation rows "
            f"({rule_text()})"
        )
    best = min(comparisons, key=lambda c: c.mae)
    return True, (
        f"val/mae {four(model)} beats every baseline (the best: {best.name} {four(best.mae)}) on "
        f"{rows} validation rows ({rule_text()})"
    )
