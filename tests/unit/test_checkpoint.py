"""Consolidated checkpoint: weights_only round trip, refusal of other formats,
prepare-checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from enn_core.checkpoint import FORMAT_VERSION, load_model, save_consolidated
from enn_core.config import load_config
from enn_core.errors import ConfigError, StaleOutputError, UntrustedCheckpointError
from enn_core.model import build_model
from enn_core.paths import Layout
from enn_core.stage import make_context
from enn_core.stages import PREPARE_CHECKPOINT
from tests.fixtures.model import make_features, make_manifest


def test_round_trip_weights_only(tmp_path, manifest, tiny_cfg):
    model = build_model(tiny_cfg, manifest)
    with torch.no_grad():
        model.label_mean.add_(torch.arange(20.0).reshape(5, 4))  # per-cell stats survive
    path = save_consolidated(
        tmp_path / "m.pt", model, tiny_cfg, manifest, {"epoch": 3, "p": tmp_path}
    )
    raw = torch.load(path, weights_only=True)
    assert raw["format_version"] == FORMAT_VERSION and raw["data_fingerprint"] == "abc123"
    assert raw["data"]["label_shape"] == [5, 4] and raw["meta"]["epoch"] == 3
    assert raw["model_config"]["d_model"] == 16
    loaded, ckpt = load_model(path)
    assert not loaded.training
    x = torch.from_numpy(make_features(5))
    torch.testing.assert_close(loaded.predict(x), model.eval().predict(x), rtol=0, atol=0)
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_wrongly_shaped_tensor_is_refused_naming_it(tmp_path, manifest, tiny_cfg):
    """A checkpoint whose tensor does not fit its own config: one line naming the tensor."""
    model = build_model(tiny_cfg, manifest)
    path = save_consolidated(tmp_path / "m.pt", model, tiny_cfg, manifest)
    raw = torch.load(path, weights_only=True)
    name = next(k for k, v in raw["state_dict"].items() if v.ndim == 2)
    raw["state_dict"][name] = torch.zeros(3, 3)
    torch.save(raw, path)
    with pytest.raises(StaleOutputError) as e:
        load_model(path)
    assert f"{name} has shape [3, 3] there" in str(e.value) and "\n" not in str(e.value)


def test_compiled_prefix_stripped(tmp_path, manifest, tiny_cfg):
    model = build_model(tiny_cfg, manifest)
    sd = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    save_consolidated(tmp_path / "m.pt", sd, tiny_cfg, manifest)
    loaded, _ = load_model(tmp_path / "m.pt")
    assert set(loaded.state_dict()) == set(model.state_dict())


def test_refuses_wrong_version_and_garbage(tmp_path, manifest, tiny_cfg):
    path = save_consolidated(tmp_path / "m.pt", build_model(tiny_cfg, manifest), tiny_cfg, manifest)
    ckpt = torch.load(path, weights_only=True)
    ckpt["format_version"] = 99
    torch.save(ckpt, tmp_path / "v99.pt")
    with pytest.raises(StaleOutputError, match="format_version=99"):
        load_model(tmp_path / "v99.pt")
    for junk in (b"not a checkpoint", b"junk"):
        (tmp_path / "junk.pt").write_bytes(junk)
        with pytest.raises(StaleOutputError, match="junk.pt: not a readable") as e:
            load_model(tmp_path / "junk.pt")
        assert "weights_only" not in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(StaleOutputError, match="run prepare-checkpoint"):
        load_model(tmp_path / "missing.pt")


class Shell:
    """An attacker's model.pt: unpickling it runs a shell command (a module torch blocks)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _touch(path: str) -> None:
    Path(path).touch()


class Touch:
    """The same through a harmless function of a module torch does not block (its refusal
    reads differently: "This file can still be loaded...", in bold)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (_touch, (str(self.marker),))


@pytest.mark.parametrize(
    ("payload", "names"), [(Shell, "posix.system"), (Touch, "test_checkpoint._touch")]
)
def test_a_crafted_model_file_is_refused_in_one_line_and_runs_nothing(tmp_path, payload, names):
    marker = tmp_path / "MARKER"
    path = tmp_path / "model.pt"
    torch.save({"format_version": FORMAT_VERSION, "state_dict": payload(marker)}, path)
    with pytest.raises(UntrustedCheckpointError) as e:
        load_model(path)
    msg = str(e.value)
    assert not marker.exists()
    assert e.value.exit_code == 4 and "\n" not in msg and "\x1b" not in msg, msg
    assert "weights_only" not in msg, msg  # torch's advice: load it again with it off
    assert msg.startswith(f"{path}: holds something other than tensors and plain values"), msg
    assert names in msg and "nothing in it ran" in msg and "re-train" in msg, msg
    assert e.value.__suppress_context__  # torch's message is not in a traceback either


def _ctx(tmp_path, overrides=()):
    (tmp_path / "params.yaml").write_text("{}\n")
    staged = tmp_path / "outputs" / "stage-data"
    staged.mkdir(parents=True, exist_ok=True)
    # the model's part of a manifest, and the file-level keys a staged manifest always has
    manifest = {
        **make_manifest(),
        "features": {"file": "features.npy", "dtype": "float32", "shape": [24, 4]},
        "splits": {},
        "files": {},
    }
    (staged / "manifest.json").write_text(json.dumps(manifest))
    cfg = load_config(None, ["model.d_model=16", "model.heads=2", "model.layers=1", *overrides])
    return cfg, make_context(cfg, Layout.for_root(tmp_path), PREPARE_CHECKPOINT, "r1")


def test_prepare_checkpoint_seeded_bit_identical(tmp_path):
    cfg, ctx = _ctx(tmp_path)
    first = PREPARE_CHECKPOINT.work(cfg, ctx)
    bytes1 = (ctx.output() / "init.pt").read_bytes()
    second = PREPARE_CHECKPOINT.work(cfg, ctx)
    assert (ctx.output() / "init.pt").read_bytes() == bytes1 and first.sha256 == second.sha256
    info = json.loads((ctx.output() / "init.json").read_text())
    assert info["sha256"] == first.sha256 and info["init_from"] == "fresh"
    cfg2, ctx2 = _ctx(tmp_path, ["model.init_seed=1"])
    assert PREPARE_CHECKPOINT.work(cfg2, ctx2).sha256 != first.sha256
    model, _ = load_model(ctx.output() / "init.pt")
    assert model.describe()["layers"] == 1


def test_prepare_checkpoint_warm_start_and_errors(tmp_path):
    cfg, ctx = _ctx(tmp_path)
    PREPARE_CHECKPOINT.work(cfg, ctx)
    src = tmp_path / "prev.pt"
    src.write_bytes((ctx.output() / "init.pt").read_bytes())
    cfg_w, ctx_w = _ctx(tmp_path, ["checkpoint.init_from=prev.pt", "model.init_seed=5"])
    # model config differs (init_seed) -> refused with the fix named
    with pytest.raises(ConfigError, match="another model config"):
        PREPARE_CHECKPOINT.work(cfg_w, ctx_w)
    cfg_w, ctx_w = _ctx(tmp_path, ["checkpoint.init_from=prev.pt"])
    assert PREPARE_CHECKPOINT.work(cfg_w, ctx_w).init_from == "prev.pt"
    (tmp_path / "outputs" / "stage-data" / "manifest.json").unlink()
    with pytest.raises(StaleOutputError, match="run stage-data first"):
        PREPARE_CHECKPOINT.work(cfg, ctx)
    assert (ctx.output() / "init.pt").exists()  # earlier output untouched
