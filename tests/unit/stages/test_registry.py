"""The stage registry is the one definition of a stage: dvc.yaml, the CLI, the Prefect tasks,
the README and the code all agree with it, and nothing outside the specs names a stage."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from enn_core import stages
from enn_core.stages import ALL, FLOWS, PREDICTION, TRAINING, StageSpec

ROOT = Path(__file__).resolve().parents[3]
SPEC_DIR = ROOT / "enn_core" / "stages"
DVC_FILES = {"training": ROOT / "dvc.yaml", "prediction": ROOT / "prediction" / "dvc.yaml"}


def _deps(entry: dict) -> set[str]:
    return {str(d) for d in entry.get("deps", [])}


def _outs(entry: dict, key: str) -> list[str]:
    return [next(iter(o)) if isinstance(o, dict) else str(o) for o in entry.get(key, [])]


@pytest.mark.parametrize("flow", list(FLOWS))
def test_dvc_yaml_has_exactly_the_flows_stages(flow):
    """Each spec is a dvc.yaml stage of its name, command, params, outputs, deps and metrics."""
    dvc = yaml.safe_load(DVC_FILES[flow].read_text())["stages"]
    specs = FLOWS[flow]
    assert list(dvc) == [s.dvc_name for s in specs], f"{DVC_FILES[flow]} vs the {flow} specs"
    up = "" if flow == "training" else "../"  # prediction/dvc.yaml's paths start in prediction/
    flag = "" if flow == "training" else " --pipeline prediction"
    for spec in specs:
        entry = dvc[spec.dvc_name]
        where = f"{DVC_FILES[flow].name}:{spec.dvc_name}"
        assert entry["cmd"] == f"{up}scripts/enn {spec.name}{flag}", where
        assert tuple(entry.get("params", [])) == spec.sections, where
        assert _outs(entry, "outs") == [f"outputs/{spec.name}"], where
        assert all(o["persist"] for o in entry["outs"][0].values()), where
        wanted = {f"outputs/{s.name}" for s in spec.inputs} | {up + c for c in spec.code}
        assert wanted <= _deps(entry), f"{where} misses deps {sorted(wanted - _deps(entry))}"
        metrics = [f"outputs/metrics/{spec.name}.json"] if spec.metrics else []
        assert _outs(entry, "metrics") == metrics, where


def _specs_in(module) -> list[StageSpec]:
    return [v for v in vars(module).values() if isinstance(v, StageSpec)]


def test_every_spec_module_is_registered_and_named_after_its_stage():
    """A spec defined in enn_core/stages/ but missing from its flow's tuple fails here; each
    training stage has a module named after it."""
    found: set[str] = set()
    for path in sorted(SPEC_DIR.glob("*.py")):
        module = importlib.import_module(f"enn_core.stages.{path.stem}")
        found |= {s.key for s in _specs_in(module)}
    assert found == {s.key for s in ALL}
    assert len({s.key for s in ALL}) == len(ALL), "spec keys must be unique"
    for spec in TRAINING:
        assert (SPEC_DIR / f"{spec.dvc_name}.py").is_file(), spec.key
    for flow, specs in FLOWS.items():
        assert all(s.flow == flow for s in specs), flow
        assert len({s.name for s in specs}) == len(specs), f"{flow}: names repeat"


def _lazy_imports(fn) -> list[tuple[str, str]]:
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    ]


@pytest.mark.parametrize("spec", ALL, ids=lambda s: s.key)
def test_work_reaches_its_implementation(spec):
    """Each work function imports an implementation that exists (go-to-definition follows it),
    and the stage's inputs are stages of its own flow that come before it."""
    for module, name in _lazy_imports(spec.work):
        assert hasattr(importlib.import_module(module), name), f"{spec.key}: {module}.{name}"
    order = FLOWS[spec.flow]
    for upstream in spec.inputs:
        assert upstream in order[: order.index(spec)], f"{spec.key} reads {upstream.key}"
    for section in spec.sections:
        assert section in {
            "data",
            "model",
            "train",
            "checkpoint",
            "validate",
            "predict",
            "collapse",
            "export",
        }


def test_cli_and_prefect_tasks_come_from_the_specs():
    from flows.cli import build_parser
    from tasks.prefect_task import stage_task

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for spec in TRAINING:
        assert spec.name in sub.choices
        description = sub.choices[spec.name].description
        assert description.startswith(f"{spec.help}\n\nreads: ") and "\nwrites: " in description
    for spec in ALL:
        assert stage_task(spec).name == spec.name
    for spec in PREDICTION:
        assert stages.lookup(spec.name, "prediction") is spec


def test_config_reference_table_lists_each_stages_sections():
    text = (ROOT / "docs" / "config.md").read_text()
    for spec in TRAINING:
        row = re.search(rf"^\| `{spec.name}` \| ([^|]*) \|", text, re.M)
        assert row, f"docs/config.md's stage table has no row for {spec.name}"
        shown = tuple(re.findall(r"`(\w+)`", row.group(1)))
        assert shown == spec.sections, spec.name


def test_importing_the_registry_and_the_cli_imports_no_torch():
    code = (
        "import sys, enn_core.stages, flows.cli; flows.cli.build_parser(); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr


# -- nothing outside the specs names a stage -------------------------------------------------

STAGE_WORDS = {s.name for s in ALL} | {s.key for s in ALL} | {s.dvc_name for s in ALL}
# Words that are also something else here; each use names what it is.
OTHER_MEANINGS = {
    ("enn_core/runtime/dist.py", "predict"): "the model's predict() method (FSDP forward hook)",
    ("enn_core/train/evaluate.py", "validate"): "the worker's heartbeat phase",
    ("enn_core/doctor/export.py", "export"): "the doctor's layer name",
    ("enn_core/doctor/__init__.py", "export"): "the doctor's layer name",
}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _names_a_stage(value: str) -> str | None:
    """The stage word `value` is, or names as a folder of a path (`outputs/<stage>/...`)."""
    if value in STAGE_WORDS:
        return value
    parts = value.split("/")
    if "outputs" in parts or re.search(r"\.(json|pt|npy|yaml|lock)$", value):
        return next((p for p in parts if p in STAGE_WORDS), None)
    return None


def test_no_stage_is_named_outside_the_specs():
    """A string constant (not a docstring) that is a stage's name, key or DVC name, or a path
    with such a segment, outside enn_core/stages/ means a stage is spelled out again."""
    bad = []
    for pkg in ("enn_core", "tasks", "flows"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("enn_core/stages/"):
                continue
            tree = ast.parse(path.read_text())
            skip = _docstrings(tree)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
                    continue
                word = _names_a_stage(node.value)
                if word and id(node) not in skip and (rel, word) not in OTHER_MEANINGS:
                    bad.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not bad, "stage names outside enn_core/stages/ (use the spec):\n" + "\n".join(bad)


def test_the_collapse_check_literal_lives_in_at_most_two_files():
    hits = [
        p.relative_to(ROOT).as_posix()
        for pkg in ("enn_core", "tasks", "flows")
        for p in (ROOT / pkg).rglob("*.py")
        if '"collapse-check"' in p.read_text()
    ]
    assert len(hits) <= 2, hits
