"""docs/metrics.md is the one table of metric names; enn_core/metric_names.py agrees with it.

`documented()` turns the table into patterns; the e2e tier checks every metric and
`resolved.` parameter a real run logs, and every DVC metrics file, against them
(tests/e2e/test_models_in_mlflow.py)."""

from __future__ import annotations

import re
from pathlib import Path

from enn_core import metric_names as mn

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
PLACEHOLDERS = {
    "<split>": "(val|test)",
    "<naive>": "(" + "|".join((*mn.NAIVE, mn.NAIVE_BEST)) + ")",
    "<fitted>": "(ridge|gbt)",
    "<candidate>": "(raw|calibrated|fp32|per_sample)",
    "<format>": "(onnx|torch_export)",
    "<name>": "[a-z0-9_]+",
}


def cells() -> list[str]:
    """The first column of docs/metrics.md's tables."""
    return re.findall(r"^\| `([^`]+)` \|", DOC.read_text(), re.M)


def documented() -> list[re.Pattern[str]]:
    """Each documented name as a full-match pattern (a parameter's `<name>` may be dotted)."""
    out = []
    for cell in cells():
        pattern = re.escape(cell)
        for hole, regex in PLACEHOLDERS.items():
            if cell.startswith(mn.RESOLVED) and hole == "<name>":
                regex = "[a-z0-9_.]+"
            pattern = pattern.replace(re.escape(hole), regex)
        out.append(re.compile(pattern))
    return out


def undocumented(names: set[str]) -> list[str]:
    patterns = documented()
    return sorted(n for n in names if not any(p.fullmatch(n) for p in patterns))


def test_the_code_names_are_in_the_table():
    names = {mn.PROMOTION_METRIC, mn.PROMOTION_BASELINE, *mn.TRAIN_SUMMARY.values()}
    names |= {mn.result(s, n) for s in mn.SPLITS for n in mn.HEADLINE}
    names |= {mn.telemetry("bottleneck/code"), mn.resolved("runtime.world_size")}
    assert not undocumented(names)


def test_one_style():
    for cell in cells():
        if cell.startswith(mn.RESOLVED):
            assert "/" not in cell and re.fullmatch(r"[a-z0-9_.<>]+", cell), cell  # dotted
        else:
            assert "." not in cell and re.fullmatch(r"[a-z0-9_<>]+(/[a-z0-9_<>]+)+", cell), cell
    assert len(set(cells())) == len(cells()), "a name listed twice"


def test_telemetry_sorts_after_the_learning_curves():
    assert sorted(["epoch/", "step/", mn.TELEMETRY])[-1] == mn.TELEMETRY
