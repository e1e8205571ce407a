"""Imports point flows -> tasks -> enn_core only, and inside enn_core down its layers (the
edges that once ran back up stay gone; a TYPE_CHECKING import counts)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.fixtures.project import ROOT


def _modules(path: Path) -> set[str]:
    """Every module `path` imports, dotted, TYPE_CHECKING and function-level imports too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _imports(path: Path) -> set[str]:
    return {name.split(".")[0] for name in _modules(path)}


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


# Inside enn_core: (files, modules they must not import, why).
DOWNWARD = (
    (
        "enn_core/data/*.py",
        ("enn_core.progress", "enn_core.runtime"),
        "data sits below the runtime (a bar comes from enn_core.bars)",
    ),
    (
        "enn_core/stage.py",
        ("enn_core.stages",),
        "the stage contract is named by the registry (stages/spec.py), never the reverse",
    ),
)


def test_enn_core_imports_point_down_its_layers():
    bad = []
    for pattern, banned, why in DOWNWARD:
        for f in sorted(ROOT.glob(pattern)):
            hit = [m for m in _modules(f) if any(m == b or m.startswith(b + ".") for b in banned)]
            if hit:
                bad.append(f"{f.relative_to(ROOT)} imports {sorted(hit)}: {why}")
    assert not bad, "imports running back up enn_core's layers:\n" + "\n".join(bad)
