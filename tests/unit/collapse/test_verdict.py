"""collapse-check's verdict on a label of the user's own that is mostly zeros (68%): it was one
600-character line saying "retrain or change the model" without naming the label's shape or
what to try."""

from __future__ import annotations

import dataclasses

import numpy as np

from enn_core.collapse.candidates import check_candidates
from enn_core.collapse.report import verdict_lines
from tests.fixtures.evaluate import Constant, check_rows, collapse_cfg


def test_a_zero_inflated_label_is_named_with_what_to_try():
    rows = check_rows()
    target = np.array(rows.target, dtype=np.float64)
    zeros = np.random.default_rng(0).random(target.shape) < 0.68
    rows = dataclasses.replace(rows, target=np.where(zeros, 0.0, target))
    report, cal = check_candidates(Constant(), rows, collapse_cfg(), "fp32")
    assert cal is None and report.cause.label_mode == 0.0
    lines = verdict_lines(report, "l1")
    assert 2 <= len(lines) <= 3 and all(len(line) <= 160 for line in lines), lines
    assert lines[0].startswith("cause: the label is mostly one value (6") and "are 0)" in lines[0]
    assert lines[1].startswith("try: train.loss=mse or huber") and "l1 pulls to it" in lines[1]


def test_another_collapse_says_its_cause_and_what_to_try_in_short_lines():
    report, _ = check_candidates(Constant(), check_rows(), collapse_cfg(), "fp32")
    lines = verdict_lines(report)
    assert lines[0].startswith("cause: the model's predictions themselves collapsed"), lines
    assert lines[1].startswith("try: ") and all(len(line) <= 160 for line in lines), lines
