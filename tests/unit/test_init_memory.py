"""prepare-checkpoint holds the model once (issue 55): a fresh start is built once, with its
own seeded initialisation, and written from its own tensors; a warm start is built with its
parameters on the meta device and the source's mapped tensors assigned to it. Before, writing
`init.pt` copied every weight first (twice the model at the peak), and a warm start built an
initialised model it then overwrote. The same seed still gives the same `init.pt`, byte for
byte, as the old path: the seeded model written from a copy of its weights.

Real staged data, the real stage, real files; the peak is the process's anonymous memory
(enn_core.runtime.memory.host_peak).
"""

from __future__ import annotations

import gc
import io
import shutil
from pathlib import Path

import pytest
import torch

from enn_core.checkpoint import make_checkpoint, read_checkpoint
from enn_core.data.manifest import read_manifest
from enn_core.model import ModelCode, build_model
from enn_core.paths import Layout
from enn_core.runtime.memory import host_peak, sampled_anon_peak
from enn_core.stage import make_context
from enn_core.stages import PREPARE_CHECKPOINT
from enn_core.summaries import InitSummary
from tests.fixtures.train import staged_dir, tiny_cfg

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
# the models under names no other test imports (a module imported from another folder first is
# refused: enn_core.model.custom)
WIDE = ["model.preset=custom", "model.factory=wideinit55.model:build"]
# 8 blocks of 1536 x 1536: 18.9 million parameters, 76 MB of float32
BIG = [*WIDE, "model.options={width: 1536, blocks: 8}"]

TIED = '''
import math

import torch
from torch import nn


class Tied(nn.Module):
    """A tied weight (written under two names), a weight drawn in __init__ outside any
    reset_parameters, and a buffer."""

    def __init__(self, width, shape):
        super().__init__()
        self.shape = tuple(shape)
        cells = math.prod(shape)
        self.stem = nn.Linear(width, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.scale = nn.Parameter(torch.randn(8) * 0.1)
        self.register_buffer("shift", torch.rand(cells))
        self.head = nn.Linear(8, cells)

    def forward(self, x):
        out = self.head(self.b(self.a(self.stem(x))) * self.scale) + self.shift
        return out.reshape(len(x), *self.shape)


def build(spec):
    return Tied(spec.encoded_dim, spec.label_shape)
'''


def _project(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    staged_dir(root, tiny_cfg())
    shutil.copytree(REPO / "examples" / "wide_mlp", root / "wideinit55")
    (root / "tiedinit55").mkdir()
    (root / "tiedinit55" / "model.py").write_text(TIED)
    return root


def _prepare(root: Path, *overrides: str) -> InitSummary:
    cfg = tiny_cfg(*overrides)
    ctx = make_context(cfg, Layout.for_root(root), PREPARE_CHECKPOINT, "r")
    return PREPARE_CHECKPOINT.work(cfg, ctx)


def _old_init_pt(root: Path, *overrides: str) -> bytes:
    """init.pt as prepare-checkpoint wrote it before: the seeded model, its weights copied."""
    cfg = tiny_cfg(*overrides)
    staged = root / "outputs" / "stage-data"
    written = read_checkpoint(root / "outputs" / "prepare-checkpoint" / "init.pt")
    code = ModelCode.of(cfg.model, root)
    manifest = read_manifest(staged)
    model = build_model(cfg.model, manifest.data_spec(), data_dir=staged, code=code)
    ckpt = make_checkpoint(model, cfg.model, manifest, written.meta, copy=True)
    buf = io.BytesIO()
    torch.save(ckpt.to_file(), buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return _project(tmp_path_factory.mktemp("init-memory") / "project")


@pytest.mark.parametrize(
    "overrides",
    [
        ("model.preset=spatiotemporal", "model.init_seed=7"),
        ("model.preset=spatiotemporal", "model.conditioning=film+cross", "model.prior_weight=0.3"),
        ("model.preset=tabular", "model.init_seed=11"),
        (*WIDE, "model.options={width: 24, blocks: 3}"),
        ("model.preset=custom", "model.factory=tiedinit55.model:build", "model.init_seed=5"),
    ],
    ids=["spatiotemporal", "spatiotemporal-prior", "tabular", "custom", "custom-tied"],
)
def test_the_same_seed_writes_the_same_init_pt_as_the_old_path(project, overrides):
    _prepare(project, *overrides)
    got = (project / "outputs" / "prepare-checkpoint" / "init.pt").read_bytes()
    assert got == _old_init_pt(project, *overrides)
    # and the seed is what decides it: another seed, other weights
    _prepare(project, *overrides, "model.init_seed=999")
    assert (project / "outputs" / "prepare-checkpoint" / "init.pt").read_bytes() != got


def test_prepare_checkpoint_holds_the_model_once_fresh_and_none_of_it_warm(project):
    # the first fresh and warm starts import and set up what they need (about 25 MB, whatever
    # the model's size): done on a small model first, so that the peaks below are the model's
    small = [*WIDE, "model.options={width: 32, blocks: 1}"]
    source = project / "earlier"
    source.mkdir(exist_ok=True)
    shutil.copy(_prepare(project, *small).path, source / "model.pt")
    _prepare(project, *small, f"checkpoint.init_from={source}")
    gc.collect()
    fresh: list[InitSummary] = []
    peak = host_peak(lambda: fresh.append(_prepare(project, *BIG)))
    size = fresh[0].parameters * 4
    assert size > 70e6
    # the model itself and little else (before: twice it, the model and a copy to write)
    assert peak.bytes < 1.25 * size, (peak, size)

    shutil.copy(fresh[0].path, source / "model.pt")
    gc.collect()
    warm: list[InitSummary] = []
    # sampled: the source's file pages are mapped while it runs and unmapped at its end, which
    # host_peak (VmHWM) would count as anonymous memory
    peak = sampled_anon_peak(
        lambda: warm.append(_prepare(project, *BIG, f"checkpoint.init_from={source}"))
    )
    # the source's weights are its file's pages (before: an initialised model they overwrote)
    assert peak.bytes < 0.25 * size, (peak, size)
    theirs = read_checkpoint(source / "model.pt").state_dict
    mine = read_checkpoint(warm[0].path).state_dict
    assert set(mine) == set(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
