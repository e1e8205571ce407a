"""Your own nn.Module through the pipeline: `model.preset: custom` and `model.factory`.

The contract (README, "Your own model"):

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

import importlib
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from enn_core.config.model import ModelConfig
from enn_core.errors import ConfigError
from enn_core.model.encoding import FeatureEncoder, parse_feature_specs
from enn_core.model_code import ModelCode, code_root


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
    """The callable `code.factory` names, imported from `code.root`; errors are one line."""
    module_name, func = code.factory.split(":", 1)
    with _on_path(code_root(code.factory, code.root)):
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # the user's module: any error while importing it
            raise ConfigError(
                f"model.factory={code.factory!r}: importing {module_name} failed: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ) from e
    fn = getattr(module, func, None)
    if not callable(fn):
        raise ConfigError(f"model.factory={code.factory!r}: {module_name} has no function {func!r}")
    return fn


def model_spec(manifest: Mapping[str, Any], encoder: FeatureEncoder) -> ModelSpec:
    raw = list(manifest["feature_specs"])
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
        label_shape=tuple(int(s) for s in manifest["label_shape"]),
        label_axes=tuple(manifest.get("label_axes") or ()),
        label_axis_values=dict(manifest.get("label_axis_values") or {}),
    )


def build_body(
    cfg: ModelConfig, spec: ModelSpec, code: ModelCode, n_features: int
) -> tuple[nn.Module, bool]:
    """(the user's module, whether it takes raw features), its output shape checked on two
    zero rows; errors name the factory and the fix."""
    factory = import_factory(code)
    try:
        body = factory(spec, **dict(cfg.options))
    except Exception as e:  # the user's code: its error, on one line, named
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(
            f"model.factory={cfg.factory!r} with model.options {dict(cfg.options)}: "
            f"{type(e).__name__}: {first}"
        ) from e
    if not isinstance(body, nn.Module):
        raise ConfigError(
            f"model.factory={cfg.factory!r} returned a {type(body).__name__}, not an nn.Module"
        )
    raw = bool(getattr(body, "raw_features", False))
    width = n_features if raw else spec.encoded_dim
    with torch.no_grad():
        out = body.eval()(torch.zeros(2, width))
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
