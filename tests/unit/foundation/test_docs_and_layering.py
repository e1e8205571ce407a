"""The generated config reference is fresh; imports point flows -> tasks -> enn_core only."""

from __future__ import annotations

import ast
from pathlib import Path

from enn_core.config import docs

ROOT = Path(__file__).resolve().parents[3]


def test_config_reference_is_fresh():
    assert docs.DOC.read_text() == docs.render(), (
        "docs/config.md is stale: run python -m enn_core.config.docs"
    )


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


def test_one_name_everywhere():
    """Each stage: tasks/<module>.py, a Prefect task of that name, a dvc stage, a CLI subcommand."""
    import yaml

    from enn_core.paths import STAGES, dvc_name
    from flows.cli import build_parser

    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for stage in STAGES:
        mod = stage.replace("-", "_")
        assert (ROOT / "tasks" / f"{mod}.py").exists(), stage
        assert f'stage_task("{stage}")' in (ROOT / "tasks" / f"{mod}.py").read_text()
        assert dvc_name(stage) in dvc
        assert stage in sub.choices
