"""Your own model's code: the factory's module must lie in the project (links resolved), and
whatever the factory does other than return a module fails its stage with one ConfigError
naming it: an exception, `sys.exit(0)` (the stage exited 0), a KeyboardInterrupt it raises
itself (the stage said "interrupted"). A real Ctrl-C while it runs still interrupts.
`model.options` is bounded in depth and size."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from enn_core.config import load_config
from enn_core.config.model import ModelConfig
from enn_core.errors import ConfigError
from enn_core.model import ModelCode, build_model
from enn_core.model_code import check_dvc_deps
from tests.fixtures.model import make_manifest

FACTORY = """
import os, signal, sys, time
import torch
from torch import nn

class Grid(nn.Module):
    def __init__(self, spec, forward_exits=False):
        super().__init__()
        self.shape, self.forward_exits = spec.label_shape, forward_exits
        self.w = nn.Linear(spec.encoded_dim, 1)

    def forward(self, x):
        if self.forward_exits:
            sys.exit(0)
        return self.w(x)[:, :, None].expand(-1, *self.shape)

class Sneaky(Grid):
    @property
    def raw_features(self):  # the pipeline reads it: the module's own code runs
        sys.exit(0)


def build(spec, how="ok"):
    if how == "exit0":
        sys.exit(0)
    if how == "exit3":
        raise SystemExit(3)
    if how == "hard-exit":
        os._exit(0)
    if how == "child":  # a child of the factory exits as it asks; the factory returns
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7
    if how == "interrupt":
        raise KeyboardInterrupt
    if how == "odd":
        class Odd(BaseException):
            pass
        raise Odd("odd")
    if how == "ctrl-c":  # a real Ctrl-C arrives while the factory runs
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    if how == "attribute":
        return Sneaky(spec)
    return Grid(spec, forward_exits=how == "forward")
"""


def project(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    (root / "mine").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "mine" / "grid.py").write_text(FACTORY)
    (root / "dvc.yaml").write_text(
        "stages:\n  prepare_checkpoint:\n    cmd: x\n    deps: [mine]\n"
        "  distributed_train:\n    cmd: x\n    deps: [mine]\n"
    )
    return root


def build(root: Path, factory: str, **options: object):
    cfg = ModelConfig(preset="custom", factory=factory, options=options)  # type: ignore[arg-type]
    return build_model(cfg, make_manifest(), code=ModelCode.of(cfg, root))


@pytest.fixture(autouse=True)
def forget_modules():
    """Each test imports its own project's `mine` package."""
    yield
    for name in [m for m in sys.modules if m == "mine" or m.startswith("mine.")]:
        del sys.modules[name]


@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("exit0", "SystemExit: 0 (a factory must return, not exit)"),
        ("exit3", "SystemExit: 3 (a factory must return, not exit)"),
        ("interrupt", "KeyboardInterrupt:  (a factory must return, not exit)"),
        ("odd", "Odd: odd (a factory must return, not exit)"),
        ("hard-exit", "SystemExit: os._exit(0) (a factory must return, not exit)"),
        ("forward", "the module's forward of [2, 51] failed: SystemExit: 0"),
        ("attribute", "with model.options {'how': 'attribute'}: SystemExit: 0"),
    ],
)
def test_a_factory_that_exits_or_interrupts_fails_with_its_own_error(tmp_path, how, said):
    root = project(tmp_path)
    assert build(root, "mine.grid:build").body is not None  # the module itself builds
    with pytest.raises(ConfigError) as e:
        build(root, "mine.grid:build", how=how)
    assert str(e.value).startswith("model.factory='mine.grid:build'") and said in str(e.value)


def test_os_exit_is_put_back_and_a_forked_child_still_exits_with_its_code(tmp_path):
    import os

    real = os._exit
    assert build(project(tmp_path), "mine.grid:build", how="child").body is not None
    assert os._exit is real


def test_a_real_ctrl_c_while_the_factory_runs_still_interrupts(tmp_path):
    root = project(tmp_path)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        with pytest.raises(KeyboardInterrupt):
            build(root, "mine.grid:build", how="ctrl-c")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_module_reached_through_a_link_out_of_the_project_is_refused(tmp_path):
    """Before anything is imported: the code would run while dvc.yaml tracks only the link."""
    root = project(tmp_path)
    outside = tmp_path / "outside"
    (outside / "pkg").mkdir(parents=True)
    marker = tmp_path / "ran"
    code = FACTORY + f"\nopen({str(marker)!r}, 'w').close()\n"
    (outside / "linked.py").write_text(code)
    (outside / "pkg" / "mod.py").write_text(code)
    (root / "mine" / "linked.py").symlink_to(outside / "linked.py")
    (root / "mine" / "pkg").symlink_to(outside / "pkg")
    for factory, link in (("mine.linked:build", "linked.py"), ("mine.pkg.mod:build", "pkg")):
        want = f"{root / 'mine' / link} leads outside the project, to {outside / link}"
        with pytest.raises(ConfigError, match=want):
            build(root, factory)
        with pytest.raises(ConfigError, match=want):  # the task layer's check before a stage
            check_dvc_deps(factory, root, root / "dvc.yaml", ["prepare_checkpoint"])
    assert not marker.exists()


def test_a_module_already_imported_from_elsewhere_is_refused(tmp_path):
    """`json` in the project is shadowed by the standard library's, already imported."""
    root = project(tmp_path)
    (root / "json.py").write_text(FACTORY)
    with pytest.raises(ConfigError, match=r"json was imported from .*, outside the project"):
        build(root, "json:build")


def test_options_are_bounded_in_depth_and_size():
    deep: object = 1
    for _ in range(12):
        deep = {"k": deep}
    with pytest.raises(ConfigError, match=r"model.options nest more than 8 levels deep"):
        ModelConfig(preset="custom", factory="a.b:c", options={"a": deep})  # type: ignore[arg-type]
    big = {"a": "x" * (70 << 10)}
    with pytest.raises(ConfigError, match=r"model.options is \d+ bytes as JSON, over 64 KiB"):
        ModelConfig(preset="custom", factory="a.b:c", options=big)
    assert (
        load_config(
            None, ["model.preset=custom", "model.factory=a.b:c", "model.options={a: [1, {b: 2}]}"]
        ).model.options["a"][1]["b"]
        == 2
    )
