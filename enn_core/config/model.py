"""Model: the ENN presets. (Owned by the model issue.)"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Literal

from enn_core.config.fields import FrozenMap, frozen
from enn_core.errors import ConfigError

FACTORY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


@frozen
class ModelConfig:
    preset: Literal["spatiotemporal", "tabular", "custom"] = "spatiotemporal"
    """Model preset: factorized section/hour attention over output-axis tokens, a residual MLP,
    or your own nn.Module built by `model.factory` (README, "Your own model")."""

    factory: str = ""
    """`package.module:function` that builds your model (preset custom), importable from the
    project's root. Also the only factory a checkpoint may name: loading a checkpoint built by
    another factory is refused, so a checkpoint never chooses what code runs."""

    options: Mapping[str, Any] = FrozenMap()
    """preset custom: keyword options passed to the factory (JSON types only: numbers, strings,
    booleans, lists, mappings). The other model.* fields are the built-in presets' own."""

    d_model: int = 64
    """Width of tokens and hidden layers."""

    heads: int = 4
    """Attention heads (must divide d_model)."""

    layers: int = 2
    """Blocks (attention blocks for spatiotemporal, residual blocks for tabular)."""

    embed_dim: int = 16
    """Embedding width of each categorical feature."""

    dropout: float = 0.0
    """Dropout probability."""

    init_seed: int = 0
    """Seed of the initial weights (prepare-checkpoint)."""

    conditioning: Literal["film", "cross", "film+cross"] = "film"
    """spatiotemporal: how the sample's features condition the grid tokens: FiLM modulation of every
    block, cross-attention to context tokens, or both."""

    context_tokens: int = 4
    """spatiotemporal: context tokens the grid cross-attends to (conditioning with 'cross')."""

    feature_dropout: float = 0.0
    """Training only: probability of zeroing a whole feature's encoding per sample (what an unseen
    category looks like), so the model learns predictions that do not lean on one key."""

    cyclic_embeddings: bool = True
    """A categorical feature with a cycle (the month) gets an embedding besides its sin/cos;
    false = sin/cos only, so that a month no training row had lies between its neighbours
    instead of meeting an embedding no gradient moved."""

    ffn_mult: int = 2
    """Hidden width of the per-token MLP as a multiple of d_model."""

    def __post_init__(self) -> None:
        self._check_custom()
        if self.d_model < 1 or self.layers < 1 or self.heads < 1:
            raise ConfigError("model.d_model, model.layers and model.heads must be >= 1")
        if self.d_model % self.heads:
            ok = [h for h in (1, 2, 4, 8, 16) if self.d_model % h == 0]
            raise ConfigError(
                f"model.heads={self.heads} does not divide model.d_model={self.d_model}; "
                f"pick heads in {ok}"
            )
        if not 0 <= self.dropout < 1:
            raise ConfigError(
                f"model.dropout={self.dropout} is outside [0, 1); use e.g. 0.0 or 0.1"
            )
        if not 0 <= self.feature_dropout < 1:
            raise ConfigError(
                f"model.feature_dropout={self.feature_dropout} is outside [0, 1); "
                "use e.g. 0.0 or 0.2"
            )
        if self.embed_dim < 1:
            raise ConfigError(f"model.embed_dim={self.embed_dim} must be >= 1 (e.g. 16)")
        if self.ffn_mult < 1:
            raise ConfigError(f"model.ffn_mult={self.ffn_mult} must be >= 1 (e.g. 2)")
        if self.context_tokens < 1:
            raise ConfigError(f"model.context_tokens={self.context_tokens} must be >= 1 (e.g. 4)")

    def _check_custom(self) -> None:
        if self.factory and not FACTORY.match(self.factory):
            raise ConfigError(
                f"model.factory={self.factory!r} is not 'package.module:function'; "
                "e.g. examples.tcn.model:build"
            )
        if self.preset == "custom" and not self.factory:
            raise ConfigError(
                "model.preset=custom needs model.factory ('package.module:function' that "
                "builds your nn.Module, e.g. examples.tcn.model:build)"
            )
        if self.options and self.preset != "custom":
            raise ConfigError(
                f"model.options is for model.preset=custom (here {self.preset!r}); remove it "
                "or set model.preset=custom"
            )
        _check_json("model.options", self.options)


def _check_json(key: str, value: Any) -> None:
    """JSON types only (checkpoints load with weights_only=True, which takes nothing else)."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{key}: key {k!r} is not a string; quote it")
            _check_json(f"{key}.{k}", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(f"{key}[{i}]", v)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value} is not finite; give a finite number")
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise ConfigError(
            f"{key}={value!r} is a {type(value).__name__}; options hold JSON types only "
            "(numbers, strings, booleans, lists, mappings)"
        )
