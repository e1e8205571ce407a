"""Imports point flows -> tasks -> enn_core only."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.fixtures.project import ROOT


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_layering():
    forbidden = {
        "enn_core": {"prefect", "mlflow", "dvc", "tasks", "flows"},
        "tasks": {"flows"},
    }
    bad = []
    for pkg, banned in forbidden.items():
        for f in (ROOT / pkg).rglob("*.py"):
            hit = _imports(f) & banned
            if hit:
                bad.append(f"{f.relative_to(ROOT)} imports {sorted(hit)}")
    assert not bad, "reverse dependency edges (flows -> tasks -> enn_core only):\n" + "\n".join(bad)
