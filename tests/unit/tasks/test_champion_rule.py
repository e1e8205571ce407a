"""The champion rule against the baselines (tasks/tracking/champion_rule.py, the decision in
tasks/tracking/registry.py): the expressway model became champion while its own results line
said "val MAE 3.536, beaten by gbt 3.429", judged on 19 validation rows against the naive
predictors only; and validate's warning named the naive predictor that beat a model but not
ridge, which beat it too."""

from __future__ import annotations

import numpy as np

from enn_core.challenge import Score
from enn_core.metrics import evaluate_split
from tasks.tracking import champion_rule
from tasks.tracking.champion_rule import MIN_ROWS, judge
from tasks.tracking.registry import decide


def errors(n: int, mean: float, seed: int) -> np.ndarray:
    return np.abs(np.random.default_rng(seed).normal(mean, 0.5, size=n))


def test_a_model_beaten_by_a_fitted_baseline_is_not_promoted_over_a_champion():
    model = errors(19, 3.5, 0)
    against = judge(model, {"naive_conditional": errors(19, 5.2, 1), "gbt": model - 0.1})
    own = Score(mae=float(model.mean()), rows=19, skipped=0)
    champion = Score(mae=9.0, rows=19, skipped=0)
    promote, why = decide(own, 5.2, champion, "1", against=against)
    assert not promote and "beaten by gbt" in why and "naive_conditional" not in why, why


def test_too_few_validation_rows_never_promote_over_a_champion():
    n = MIN_ROWS - 1
    against = judge(errors(n, 1.0, 0), {"naive_cell_mean": errors(n, 6.0, 1)})
    own = Score(mae=1.0, rows=n, skipped=0)
    promote, why = decide(own, 6.0, Score(mae=9.0, rows=n, skipped=0), "1", against=against)
    assert not promote and f"fewer than the {MIN_ROWS}" in why, why


def test_a_clear_win_on_enough_rows_promotes_and_says_the_rule():
    n = 64
    model = errors(n, 1.0, 0)
    against = judge(model, {"naive_conditional": model + 2.0, "ridge": model + 0.5})
    own = Score(mae=float(model.mean()), rows=n, skipped=0)
    promote, why = decide(own, 3.0, Score(mae=9.0, rows=n, skipped=0), "1", against=against)
    assert promote and "beats the champion's" in why
    first, why = decide(own, 3.0, None, None, against=against)
    assert first and why.startswith("the first version, and it passes the rule: "), why
    assert "paired bootstrap" in why, why


def test_a_better_version_replaces_a_champion_that_did_not_pass_the_rule_either():
    """Issue 54: version 1 became champion while ridge beat it ("the first version"), yet a
    strictly better version 2 on the same 6 validation rows stayed candidate. One rule: beat
    the champion, and pass the rule or beat a champion that did not pass it either."""
    n = 6
    model = errors(n, 1.0, 0)
    against = judge(model, {"naive_conditional": model + 2.0, "ridge": model + 0.5})
    own = Score(mae=float(model.mean()), rows=n, skipped=0)
    champion = Score(mae=float(model.mean()) + 0.3, rows=n, skipped=0)
    promote, why = decide(own, 3.0, champion, "1", against=against, champion_passed=False)
    assert promote, why
    assert "beats the champion's (version 1)" in why and "neither passes the rule" in why, why
    assert f"on {n} validation rows, fewer than the {MIN_ROWS} the rule needs" in why, why
    # a champion that passed the rule is replaced only by one that passes it too
    kept, why = decide(own, 3.0, champion, "1", against=against, champion_passed=True)
    assert not kept and "the champion passed the rule and this version does not" in why, why
    # nor by one no better than itself, passing or not
    worse = Score(mae=champion.mae + 0.1, rows=n, skipped=0)
    kept, why = decide(worse, 3.0, champion, "1", against=against, champion_passed=False)
    assert not kept and "does not beat the champion's (version 1)" in why, why


def test_the_version_tags_say_whether_it_passed_the_rule_and_the_rule_itself():
    from tasks.tracking.registry import passed_rule

    assert passed_rule({"enn.passes_rule": "yes"}) and not passed_rule({"enn.passes_rule": "no"})
    # versions registered before the tag: a first version made champion without passing
    first = "the first version, champion until one passes the rule: val/mae 3 is beaten by gbt 2"
    assert not passed_rule({"enn.champion_decision": first})
    assert passed_rule({"enn.champion_decision": "val/mae 2 beats the champion's (version 1) 3"})
    assert "\n" not in champion_rule.RULE and f"at least {MIN_ROWS}" in champion_rule.RULE
    assert "did not pass it either" in champion_rule.RULE


def test_a_win_within_the_noise_is_not_a_win():
    """A mean lower by chance: half the rows better, half worse by more or less the same."""
    n = 200
    base = errors(n, 2.0, 0)
    noise = np.random.default_rng(3).normal(0, 1.0, size=n)
    model = np.abs(base + noise) - 0.01
    (c,) = judge(model, {"ridge": base})
    assert c.rows == n and c.upper > 0 and not c.beaten


def test_the_first_version_is_champion_with_a_warning_naming_every_predictor_that_beat_it():
    n = 40
    model = errors(n, 3.0, 0)
    against = judge(model, {"naive_conditional": model - 0.2, "ridge": model - 0.1})
    own = Score(mae=float(model.mean()), rows=n, skipped=0)
    promote, why = decide(own, 2.8, None, None, against=against)
    assert promote and "champion until one passes the rule" in why, why
    assert "naive_conditional" in why and "ridge" in why


def test_validates_warning_names_every_predictor_that_beat_the_model():
    target = np.zeros((10, 2))
    pred = np.full((10, 2), 3.0)
    naive = {"naive_conditional": np.full((10, 2), 1.0), "naive_cell_mean": np.full((10, 2), 5.0)}
    _, _, flags = evaluate_split("val", pred, target, naive, fitted={"ridge": target + 2.0})
    assert len(flags) == 1, flags
    assert "naive_conditional 1" in flags[0] and "ridge 2" in flags[0], flags
    assert "naive_cell_mean" not in flags[0]


def test_the_bootstrap_holds_a_block_of_indices_whatever_the_validation_rows(monkeypatch):
    """500 resamples of n rows at once were 500 x n int64 indices and the errors they pick:
    1 GB at 127,500 validation rows (10^6 table rows), 12 GB at 10^7. Blocks of BLOCK_CELLS
    indices hold the same bound within the bootstrap's noise; below 500 x BLOCK_CELLS rows
    the draws are the ones they were."""
    import tracemalloc

    rng = np.random.default_rng(1)
    n = 20_000  # 500 x n x 16 bytes: 160 MB at once before
    model = rng.gamma(2.0, 1.0, n)
    other = model + rng.normal(0.01, 0.5, n)
    monkeypatch.setattr(champion_rule, "BLOCK_CELLS", 500 * n, raising=False)  # as before
    wide = champion_rule.beats("naive", model, other)
    monkeypatch.setattr(champion_rule, "BLOCK_CELLS", 2**18)  # 13 resamples a block
    tracemalloc.start()
    try:
        got = champion_rule.beats("naive", model, other)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak
    assert got.rows == n and got.mae == wide.mae and got.model_mae == wide.model_mae
    assert abs(got.upper - wide.upper) < 0.25 * np.std(model - other) / np.sqrt(n)
