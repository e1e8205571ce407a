"""Your own nn.Module through the pipeline: `model.preset: custom` and `model.factory`.

The contract (docs/your-model.md):

    def build(spec: ModelSpec, **options) -> nn.Module

`spec` says what the staged data holds: the features (name, kind, vocabulary size and values,
period), `encoded_dim` (the width of the pipeline's encoding of one row), the label shape and
axes.
The module maps the encoded features [B, encoded_dim] to [B, *label_shape] in normalized
label units (the loss is computed there; `predict` adds the label statistics back). A module
whose class sets `raw_features = True` gets the raw feature row [B, F] instead (categorical
values as vocabulary codes). FSDP2 shards each module of its `blocks` (an nn.ModuleList) as
one unit, then the whole model; without `blocks`, the whole model is one unit.

The factory is imported from the project's root, and only when it is the `model.factory` of
the params in use (`ModelCode`): a checkpoint names its factory, and one naming another is
refused, so that a checkpoint never chooses what code runs.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from enn_core.config.model import ModelConfig
from enn_core.data.manifest import DataSpec
from enn_core.errors import ConfigError
from enn_core.model.encoding import FeatureEncoder, parse_feature_specs
from enn_core.model_code import ModelCode, check_inside, code_root


@dataclass(frozen=True)
class FeatureInfo:
    name: str
    kind: str  # "continuous", "categorical" or "cyclic"
    vocab_size: int = 0  # categorical: codes 0..vocab_size-1
    period: float = 0.0  # cyclic
    vocabulary: tuple[str, ...] = ()
    """Categorical: the values as the source spells them, code i is vocabulary[i]."""


@dataclass(frozen=True)
class ModelSpec:
    """What the factory is told of the data."""

    features: tuple[FeatureInfo, ...]
    encoded_dim: int
    label_shape: tuple[int, ...]
    label_axes: tuple[str, ...] = ()
    label_axis_values: Mapping[str, list[str]] = field(default_factory=dict)


@contextmanager
def _on_path(root: str | Path) -> Iterator[None]:
    root = str(Path(root).resolve())
    added = root not in sys.path
    if added:
        sys.path.insert(0, root)
    try:
        yield
    finally:
        if added and root in sys.path:
            sys.path.remove(root)


def import_factory(code: ModelCode) -> Callable[..., nn.Module]:
    """The callable `code.factory` names, imported from `code.root`; errors are one line. The
    module must lie in the project (links resolved), before and after it is imported."""
    module_name, func = code.factory.split(":", 1)
    top = code_root(code.factory, code.root)
    check_inside(code.factory, top)
    with _on_path(top), user_code(code.factory, f": importing {module_name} failed"):
        module = importlib.import_module(module_name)
    where = getattr(module, "__file__", None)
    if where is None or not Path(where).resolve().is_relative_to(top.resolve()):
        raise ConfigError(
            f"model.factory={code.factory!r}: {module_name} was imported from {where}, outside "
            f"the project {top} (a module of that name was imported or installed already); "
            "name your module so that it is unique"
        )
    fn = getattr(module, func, None)
    if not callable(fn):
        raise ConfigError(f"model.factory={code.factory!r}: {module_name} has no function {func!r}")
    return fn


@contextmanager
def user_code(factory: str, where: str) -> Iterator[None]:
    """Any error of the user's code is one ConfigError naming the factory (`where`: what it was
    doing): an exception, and also `sys.exit()` (the stage exited 0 after "failed"), `os._exit()`
    (the whole run ended with the code the factory chose, without a word), or a
    KeyboardInterrupt the code raised itself (the stage said "interrupted"). A real Ctrl-C or
    SIGTERM meanwhile (`signals_seen`) still stops the run as one."""
    with signals_seen() as seen, no_hard_exit():
        try:
            yield
        except ConfigError:
            raise
        except BaseException as e:  # the user's code: whatever it raised or exited with
            if isinstance(e, KeyboardInterrupt) and seen:
                raise
            first = str(e).splitlines()[0] if str(e) else ""
            exits = "" if isinstance(e, Exception) else " (a factory must return, not exit)"
            raise ConfigError(
                f"model.factory={factory!r}{where}: {type(e).__name__}: {first}{exits}"
            ) from e


@contextmanager
def no_hard_exit() -> Iterator[None]:
    """`os._exit()` called by this process while the block runs raises SystemExit instead (it
    would end the run at once, with the caller's exit code and no message); a child the block
    forks still exits as it asks (multiprocessing's children end with `os._exit`)."""
    real, pid = os._exit, os.getpid()

    def hard_exit(status: int) -> NoReturn:
        if os.getpid() != pid:
            real(status)
        raise SystemExit(f"os._exit({status})")

    os._exit = hard_exit
    try:
        yield
    finally:
        os._exit = real


@contextmanager
def signals_seen() -> Iterator[list[int]]:
    """The SIGINT and SIGTERM that arrive while the block runs (in the main thread, whose
    handlers are wrapped to note them first; elsewhere no signal reaches Python code)."""
    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if callable(handler):
            previous[sig] = handler
            signal.signal(sig, functools.partial(_note, seen, handler))
    try:
        yield seen
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _note(seen: list[int], handler: Callable[..., Any], signum: int, frame: Any) -> None:
    seen.append(signum)
    handler(signum, frame)


def model_spec(data: DataSpec, encoder: FeatureEncoder) -> ModelSpec:
    raw = list(data.feature_specs)
    specs = parse_feature_specs(raw)
    lay = encoder.layout
    vocab = dict(zip(lay.categorical, lay.vocab_sizes, strict=True))
    period = dict(zip(lay.cyclic, lay.periods, strict=True))
    features = tuple(
        FeatureInfo(
            name=name,
            kind="categorical" if i in vocab else "cyclic" if i in period else "continuous",
            vocab_size=int(vocab.get(i, 0)),
            period=float(period.get(i, 0.0)),
            vocabulary=tuple(str(v) for v in raw[i].get("vocab") or ()) if i in vocab else (),
        )
        for i, name in enumerate(specs.names)
    )
    return ModelSpec(
        features=features,
        encoded_dim=int(encoder.out_dim),
        label_shape=data.label_shape,
        label_axes=data.label_axes,
        label_axis_values=dict(data.label_axis_values),
    )


def build_body(
    cfg: ModelConfig, spec: ModelSpec, code: ModelCode, n_features: int
) -> tuple[nn.Module, bool]:
    """(the user's module, whether it takes raw features), its output shape checked on two
    zero rows; errors name the factory and the fix."""
    factory = import_factory(code)
    with user_code(cfg.factory, f" with model.options {dict(cfg.options)}"):
        body = factory(spec, **dict(cfg.options))
        if not isinstance(body, nn.Module):
            raise ConfigError(
                f"model.factory={cfg.factory!r} returned a value of type "
                f"{type(body).__name__}, not an nn.Module"
            )
        raw = bool(getattr(body, "raw_features", False))  # the module's own attribute code
    width = n_features if raw else spec.encoded_dim
    with torch.no_grad(), user_code(cfg.factory, f": the module's forward of [2, {width}] failed"):
        # on the meta device when its parameters are (a checkpoint's weights come after)
        device = next((p.device for p in body.parameters()), torch.device("cpu"))
        out = body.eval()(torch.zeros(2, width, device=device))
        body.train()
    want = (2, *spec.label_shape)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"model.factory={cfg.factory!r}: the module maps [2, {width}] to {got}, not "
            f"{list(want)} ([batch, *label_shape]); make its output the label's shape"
        )
    return body, raw


def describe_body(body: nn.Module) -> dict[str, Any]:
    blocks = getattr(body, "blocks", None)
    return {
        "module": f"{type(body).__module__}.{type(body).__qualname__}",
        "fsdp_units": len(blocks) if isinstance(blocks, nn.ModuleList) else 0,
    }
