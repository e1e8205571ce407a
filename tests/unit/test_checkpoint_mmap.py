"""A checkpoint is loaded without a private copy of its weights (issue 55): they are the
file's pages (torch.load with mmap), assigned to a model built with its parameters on the
meta device, so no process holds an initialised model beside the one it loads. Before, a
worker held the file's tensors and a freshly initialised model at once: twice the model,
before FSDP2 even sharded it."""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import pytest
import torch

from enn_core.checkpoint import load_model, save_consolidated
from enn_core.config.loader import build
from enn_core.config.model import ModelConfig
from enn_core.model import ModelCode, build_model
from enn_core.runtime.memory import host_peak
from tests.fixtures.model import make_features, make_manifest

ROOT = Path(__file__).resolve().parents[2]  # the repository: examples/ is importable from it


@pytest.mark.slow  # it writes and reads 210 MB
def test_loading_a_200_mb_checkpoint_holds_no_anonymous_copy_of_its_weights(tmp_path):
    cfg = build(
        ModelConfig,
        # 8 blocks of 2560 x 2560: 52 million parameters, 210 MB of float32
        {
            "preset": "custom",
            "factory": "examples.wide_mlp.model:build",
            "options": {"width": 2560, "blocks": 8},
        },
        root=ModelConfig,
        where="params.yaml",
    )
    code = ModelCode.of(cfg, ROOT)
    x = torch.from_numpy(make_features(3))
    model = build_model(cfg, make_manifest(), code=code).eval()
    with torch.no_grad():
        want = model(x)
    path = save_consolidated(tmp_path / "init.pt", model, cfg, make_manifest())
    del model
    gc.collect()
    size = path.stat().st_size
    assert size > 200e6

    # the first load of any checkpoint imports and sets up what loading needs (tens of MB,
    # whatever the model's size): done on a small one first, so the peak below is the model's
    small = dataclasses.replace(cfg, options={"width": 64, "blocks": 1})
    tiny = build_model(small, make_manifest(), code=code)
    load_model(save_consolidated(tmp_path / "tiny.pt", tiny, small, make_manifest()), code)
    loaded: list[torch.nn.Module] = []
    # as a worker loads it: deterministic algorithms on (runtime.deterministic), under which
    # torch.empty fills every new tensor; before, that wrote each weight once as it was built
    # on the way to meta (the whole model resident, after any deterministic run in a process)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        peak = host_peak(lambda: loaded.append(load_model(path, code)[0]))
    finally:
        torch.use_deterministic_algorithms(was)
    # below a quarter of the file (before: about twice it, the file's tensors and a model)
    assert peak.bytes < size / 4, (peak, size)
    with torch.no_grad():
        torch.testing.assert_close(loaded[0](x), want)
    assert not any(p.is_meta for p in loaded[0].parameters())
    # training writes to the weights: the mapping is private, the file stays as it was
    with torch.no_grad():
        next(loaded[0].parameters()).add_(1.0)
    again, _ = load_model(path, code)
    with torch.no_grad():
        torch.testing.assert_close(again(x), want)


TIED = '''
from torch import nn


class Tied(nn.Module):
    """Two layers of one weight (tied), and a value read from a weight as it is built."""

    def __init__(self, width):
        super().__init__()
        self.stem = nn.Linear(width, 20)
        self.a = nn.Linear(20, 20)
        self.b = nn.Linear(20, 20)
        self.b.weight = self.a.weight
        self.scale = 1.0 + 0.0 * float(self.a.weight.abs().sum().item())

    def forward(self, x):
        return (self.b(self.a(self.stem(x))) * self.scale).reshape(len(x), 5, 4)


def build(spec):
    return Tied(spec.encoded_dim)
'''


def test_a_module_that_ties_or_reads_its_weights_is_built_as_before_and_loads(tmp_path):
    (tmp_path / "tied55").mkdir()
    (tmp_path / "tied55" / "model.py").write_text(TIED)
    cfg = build(
        ModelConfig,
        {"preset": "custom", "factory": "tied55.model:build"},
        root=ModelConfig,
        where="params.yaml",
    )
    code = ModelCode.of(cfg, tmp_path)
    manifest = make_manifest()
    model = build_model(cfg, manifest, code=code).eval()
    path = save_consolidated(tmp_path / "model.pt", model, cfg, manifest)
    loaded, _ = load_model(path, code)
    body = loaded.body
    assert body.b.weight is body.a.weight  # still one weight
    x = torch.from_numpy(make_features(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))


def test_writing_a_model_takes_no_copy_of_its_weights_and_a_view_is_written_alone(tmp_path):
    """save_consolidated (distributed-train's model.pt, prepare-checkpoint's init.pt) writes
    each weight as it is: before, the state was cloned first, a second model in memory at
    the moment a worker holds the most (issue 55). A view of a larger storage or a second
    name of one storage is still copied: the file holds each tensor's own bytes."""
    from enn_core.checkpoint import consolidated_state_dict, read_checkpoint

    cfg = build(
        ModelConfig,
        {
            "preset": "custom",
            "factory": "examples.wide_mlp.model:build",
            "options": {"width": 2048, "blocks": 4},  # 17M parameters, 68 MB
        },
        root=ModelConfig,
        where="params.yaml",
    )
    model = build_model(cfg, make_manifest(), code=ModelCode.of(cfg, ROOT))
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    peak = host_peak(lambda: save_consolidated(tmp_path / "model.pt", model, cfg, make_manifest()))
    assert peak.bytes < size / 4, (peak, size)  # before: the size of the model, at least
    saved = read_checkpoint(tmp_path / "model.pt").state_dict
    for name, tensor in model.state_dict().items():
        assert torch.equal(saved[name], tensor), name

    whole = torch.arange(10.0)
    state = {"a": whole, "b": whole, "view": whole[2:5], "t": torch.ones(3, 2).t()}
    out = consolidated_state_dict(state, copy=False)
    assert out["a"].untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()  # as is
    for name in ("b", "view", "t"):  # copied: a second name, a view, a strided tensor
        assert out[name].untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
        assert out[name].untyped_storage().nbytes() == out[name].numel() * 4, name
        assert torch.equal(out[name], state[name]), name
