"""Property-based checks of the trust boundary (derandomized: the `ci` profile of this
folder's conftest), one per surface a file from outside reaches, none starting a server or a
process per example:

- study records: whatever a trial's owner record says, the only process a study may signal
  is the trial it started; whatever values a record holds, a trial or `--apply` gets only
  points of `tune.space`;
- gc's view of the store and the work directory: whatever artifact locations and links they
  hold, gc removes only inside its roots and what lies outside survives;
- params files: any document of sections, nesting, anchors, aliases and duplicate keys loads
  or is one ConfigError, never another exception;
- factory behaviour: whatever the factory returns, raises or exits with, the model builds or
  the error is one ConfigError.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enn_core.config import load_config
from enn_core.config.model import ModelConfig
from enn_core.config.tune import dimensions, space_values
from enn_core.errors import ConfigError, DataError
from enn_core.model import ModelCode, build_model
from enn_core.paths import Layout
from tasks import gc
from tasks.tuning.store import TrialOwner
from tasks.tuning.study import left_here, trial_command
from tests.fixtures.model import make_manifest

SETTINGS = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])

# -- study records ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """A trial this study started (its command names this study's trial 0) and a bystander."""
    folder = tmp_path_factory.mktemp("study")
    job = folder / "trial-0" / "trial.json"
    code = "import time; time.sleep(600)"
    trial = subprocess.Popen([sys.executable, "-c", code, *trial_command(job)[1:]])
    bystander = subprocess.Popen([sys.executable, "-c", code])
    for proc in (trial, bystander):
        for _ in range(100):
            if psutil.Process(proc.pid).cmdline()[1:2] == ["-c"]:
                break
            time.sleep(0.02)
    yield job, psutil.Process(trial.pid), psutil.Process(bystander.pid)
    for proc in (trial, bystander):
        proc.kill()
        proc.wait()


@st.composite
def owner_records(draw: st.DrawFn, job: Path, trial: psutil.Process, other: psutil.Process):
    """A stored owner record: a true one, one with a field changed, or anything at all."""
    target = draw(st.sampled_from([trial, other]))
    fields = {
        "host": socket.gethostname(),
        "pid": target.pid,
        "started": target.create_time(),
        "cmdline": target.cmdline(),
    }
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(sorted(fields)))
        fields[key] = draw(
            {
                "host": st.sampled_from(["elsewhere", "", socket.gethostname() + "x"]),
                "pid": st.sampled_from([1, 0, -1, os.getpid(), trial.pid, other.pid, 2**31]),
                "started": st.floats(allow_nan=True, allow_infinity=True),
                "cmdline": st.sampled_from(
                    [
                        trial.cmdline(),
                        other.cmdline(),
                        trial_command(job),
                        trial_command(job.parent.parent / "trial-1" / "trial.json"),
                        [],
                        ["x"] * 3,
                    ]
                ),
            }[key]
        )
    garbage = st.one_of(
        st.none(), st.integers(), st.text(max_size=30), st.just("{not json"), st.just("[]")
    )
    return draw(st.one_of(st.just(json.dumps(fields)), garbage))


@SETTINGS
@given(data=st.data())
def test_an_owner_record_marks_left_only_this_host_s_own_trial_of_a_gone_study(processes, data):
    job, trial, other = processes
    raw = data.draw(owner_records(job, trial, other))
    if left_here(TrialOwner.parse(raw), job):  # a resumed study marks it failed (no signal)
        record = json.loads(raw)
        assert record["host"] == socket.gethostname()
        assert record["cmdline"][-3:] == trial_command(job)[-3:]


SPACE = load_config(
    None,
    [
        'tune.space={"train.lr": {"low": 0.001, "high": 0.1, "log": true}, '
        '"model.layers": {"low": 1, "high": 3}, "model.heads": {"choices": [1, 2, 4]}}'
    ],
).tune
VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.none(),
    st.text(max_size=20),
    st.sampled_from([0.01, 2, 4, 1, 3]),
)
KEYS = st.sampled_from(
    ["train.lr", "model.layers", "model.heads", "model.factory", "data.path", "tracking.uri", "x"]
)


@SETTINGS
@given(values=st.dictionaries(KEYS, VALUES, max_size=5))
def test_a_record_s_values_reach_a_trial_only_as_points_of_the_space(values):
    dims = dimensions(SPACE)
    try:
        point = space_values(values, dims, "s.db: trial 0", "nothing run")
    except DataError as e:
        assert str(e).startswith("s.db: trial 0 holds ") and "\n" not in str(e)
        return
    space = {d.key: d for d in dims}
    assert set(point) <= set(space)
    for key, value in point.items():
        assert space[key].holds(value)
        assert not isinstance(value, float) or math.isfinite(value)


# -- gc's view of the store and the work directory ------------------------------------------------

SEGMENTS = st.sampled_from(["..", ".", "a", "out", "in", "%2e%2e", "artifacts", "", "%00"])


@st.composite
def work_trees(draw: st.DrawFn):
    """What a work directory and the MLflow store may hold: trial folders, run directories,
    fingerprints, each a folder or a link (inside or out), and artifact locations."""
    entries = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["tune/s/trial-0", "tune/t", "runs/r", "checkpoints/f"]),
                st.sampled_from(["dir", "link-out", "link-in", "link-loop"]),
            ),
            max_size=6,
            unique_by=lambda e: e[0],
        )
    )
    uris = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["file://{root}/", "file://{art}/", "{art}/", "", "file:"]),
                st.lists(SEGMENTS, min_size=1, max_size=5),
            ),
            max_size=5,
        )
    )
    return entries, uris


def build_tree(base: Path, entries: list[tuple[str, str]]) -> tuple[Layout, Path]:
    layout = Layout(root=base / "proj", work=base / "proj" / "work")
    outside = base / "outside"
    (outside / "trial-0").mkdir(parents=True)
    for p in (outside / "keep.txt", outside / "end.json", outside / "trial-0" / "end.json"):
        p.write_text("precious")
    for rel, kind in entries:
        path = layout.work / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "dir":
            path.mkdir(parents=True, exist_ok=True)
            (path / "end.json").write_text("{}")
            (path / "COMPLETE").write_text("")
        elif kind == "link-out":
            path.symlink_to(outside, target_is_directory=True)
        elif kind == "link-in":
            path.symlink_to(layout.work, target_is_directory=True)
        else:
            path.symlink_to(path)
        old = time.time() - 30 * 86400
        os.utime(path, (old, old), follow_symlinks=False)
    return layout, outside


@SETTINGS
@given(tree=work_trees())
def test_gc_removes_only_inside_its_roots(tmp_path_factory, tree):
    entries, uris = tree
    base = tmp_path_factory.mktemp("gc")
    layout, outside = build_tree(base, entries)
    cfg = load_config(None, ["tracking.enabled=false", "gc.keep_fingerprints=0", "gc.keep_days=1"])
    planned = gc.plan(cfg, layout)
    for r in planned.removals:
        where = r.path.parent.resolve() / r.path.name if r.path.is_symlink() else r.path.resolve()
        assert where.is_relative_to(r.root.resolve()) and where != r.root.resolve(), r
    assert gc.remove(cfg, layout, planned.removals) == {}
    for p in (outside / "keep.txt", outside / "end.json", outside / "trial-0" / "end.json"):
        assert p.read_text() == "precious"
    art = layout.mlflow_artifacts
    for head, parts in uris:
        uri = head.format(root=layout.root, art=art) + "/".join(parts)
        path = gc.artifact_path(uri)
        if path is not None and gc.owned(path, art):
            assert os.path.realpath(path).startswith(str(art.resolve()) + os.sep), uri


# -- params files -----------------------------------------------------------------------------

SCALARS = st.one_of(
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
    st.sampled_from(["1e-300", "1.0e+300", ".inf", "custom", "a.b:c", "0x10", "~", "'"]),
)
SECTION_KEYS = st.sampled_from(
    ["data", "model", "train", "tune", "gc", "runtime", "tracking", "options", "space", "x"]
)
FIELD_KEYS = st.sampled_from(
    [
        "lr",
        "epochs",
        "d_model",
        "heads",
        "prior_width",
        "prior_kriging_noise",
        "factory",
        "preset",
        "options",
        "space",
        "study",
        "keep_days",
        "train.lr",
        "<<",
        "a",
    ]
)


def values(depth: int):
    if depth == 0:
        return SCALARS
    inner = values(depth - 1)
    return st.one_of(
        SCALARS,
        st.lists(inner, max_size=3),
        st.dictionaries(FIELD_KEYS, inner, max_size=3),
    )


@st.composite
def params_documents(draw: st.DrawFn) -> str:
    doc = draw(st.dictionaries(SECTION_KEYS, st.dictionaries(FIELD_KEYS, values(2), max_size=4)))
    text = yaml.safe_dump(doc, sort_keys=False) if doc else "{}\n"
    lines = text.splitlines()
    for _ in range(draw(st.integers(0, 2))):  # a duplicated line: a duplicate key
        if lines:
            lines.insert(
                draw(st.integers(0, len(lines))), lines[draw(st.integers(0, len(lines) - 1))]
            )
    depth = draw(st.integers(0, 60))  # nesting, some past the bound
    if depth:
        lines += ["model:", "  options: {a: " + "[" * depth + "]" * depth + "}"]
    if draw(st.booleans()):  # anchors and aliases, some a bomb
        width, levels = draw(st.integers(1, 9)), draw(st.integers(1, 8))
        lines += ["tune:", "  enqueue:", f"    - &a0 [{', '.join(['1'] * width)}]"]
        lines += [f"    - &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@SETTINGS
@given(text=params_documents())
def test_any_params_document_loads_or_is_one_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("params") / "params.yaml"
    path.write_text(text)
    try:
        load_config(path)
    except ConfigError as e:
        assert "\n" not in str(e).strip() or "not valid YAML" in str(e)


# -- factory behaviour --------------------------------------------------------------------------

FACTORY = """
import sys
import torch
from torch import nn

class Odd(BaseException):
    pass

class Grid(nn.Module):
    def __init__(self, shape, out):
        super().__init__()
        self.shape, self.out = shape, out
        self.w = nn.Linear(1, 1)

    def forward(self, x):
        if self.out == "exit":
            sys.exit(0)
        if self.out == "tuple":
            return (x,)
        if self.out == "wrong":
            return torch.zeros(x.shape[0], 3)
        return torch.zeros(x.shape[0], *self.shape) + self.w.weight.sum() * 0

RAISES = {e.__name__: e for e in (SystemExit, KeyboardInterrupt, Odd, ValueError,
          GeneratorExit, RecursionError, MemoryError, ImportError)}

def build(spec, raises="", arg=None, returns="module", out="ok"):
    if raises:
        raise RAISES[raises](arg) if arg is not None else RAISES[raises]()
    if returns == "none":
        return None
    if returns == "class":
        return Grid
    return Grid(spec.label_shape, out)
"""


@pytest.fixture(scope="module")
def factory_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("factory")
    (root / ".git").mkdir()
    (root / "fuzzmodels").mkdir()
    (root / "fuzzmodels" / "grid.py").write_text(FACTORY)
    yield root
    for name in [m for m in sys.modules if m.startswith("fuzzmodels")]:
        del sys.modules[name]


BEHAVIOUR = st.fixed_dictionaries(
    {},
    optional={
        "raises": st.sampled_from(
            [
                "",
                "SystemExit",
                "KeyboardInterrupt",
                "Odd",
                "ValueError",
                "GeneratorExit",
                "RecursionError",
                "MemoryError",
                "ImportError",
            ]
        ),
        "arg": st.one_of(st.integers(-3, 300), st.text(max_size=10), st.none()),
        "returns": st.sampled_from(["module", "none", "class"]),
        "out": st.sampled_from(["ok", "exit", "tuple", "wrong"]),
    },
)


@SETTINGS
@given(options=BEHAVIOUR)
def test_a_factory_builds_or_is_one_config_error(factory_root, options):
    cfg = ModelConfig(preset="custom", factory="fuzzmodels.grid:build", options=options)
    try:
        build_model(cfg, make_manifest(), code=ModelCode.of(cfg, factory_root))
    except ConfigError as e:
        assert str(e).startswith("model.factory='fuzzmodels.grid:build'") and "\n" not in str(e)
        return
    assert options.get("raises", "") == "" and options.get("out", "ok") == "ok"
    assert options.get("returns", "module") == "module"
