"""Model: the ENN presets. (Owned by the model issue.)"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, Literal

from enn_core.config.fields import FrozenMap, frozen
from enn_core.config.loader import to_plain
from enn_core.errors import ConfigError

FACTORY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
# Ranges of the values that feed the encoders' and the prior's arithmetic: a von Mises
# concentration (period / width)^2 overflowed a float at width 1e-300, and kriging's solve was
# singular at noise 1e-300 or group weight 1e300. Far wider than any useful value.
WIDTH = (1e-3, 1e6)  # in the cyclic feature's units (months)
SCALE = (1e-6, 1e9)  # label units
NOISE = (1e-6, 1e6)  # relative to the kernel's 1
GROUP = (0.0, 1e3)  # relative to the shared profile's 1
# model.options travel in every checkpoint and MLflow run: JSON of a few keyword arguments
OPTIONS_DEPTH = 8
OPTIONS_BYTES = 64 << 10


# The model presets: each has its builder in enn_core/model/enn.py (BUILDERS), which refuses
# to import while one of these lacks it.
Preset = Literal["spatiotemporal", "tabular", "custom"]


@frozen
class ModelConfig:
    preset: Preset = "spatiotemporal"
    """Model preset: factorized section/hour attention over output-axis tokens, a residual MLP,
    or your own nn.Module built by `model.factory` (docs/your-model.md)."""

    factory: str = ""
    """`package.module:function` that builds your model (preset custom), importable from the
    project's root. Also the only factory a checkpoint may name: loading a checkpoint built by
    another factory is refused, so a checkpoint never chooses what code runs."""

    options: Mapping[str, Any] = FrozenMap()
    """preset custom: keyword options passed to the factory (JSON types only: numbers, strings,
    booleans, lists, mappings); a built-in preset takes none and ignores them (so going back from
    your own model is `--set model.preset=spatiotemporal` alone). The other model.* fields are
    the built-in presets' own."""

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

    cyclic_basis: int = 0
    """How a cyclic feature (month, hour of day) is encoded: 0 = sin and cos of its first
    harmonic; K > 0 = K smooth bumps (von Mises) spread evenly over the cycle, so that a value no
    training row had is encoded as a blend of its neighbours' bumps and the model interpolates
    between them (docs/design.md, "Model quality")."""

    cyclic_width: float = 1.5
    """Width of each bump with `cyclic_basis` > 0, in the feature's own units (months for a
    month): about the standard deviation of a Gaussian over the distance round the cycle."""

    prior_weight: float = 0.0
    """Blend the network with a kernel smoother over the training rows kept inside the model
    (enn_core/model/prior.py): prediction = (1 - w) * network + w * prior. 0 = the network
    alone. A held-out month meets the network's untrained corner; the smoother interpolates
    between the months around it, and the two err differently (docs/design.md)."""

    prior_train: bool = True
    """true: the network trains through the blend (it learns what the prior misses); false: it
    trains alone and the prior is blended in at evaluation (an ensemble of two predictors)."""

    prior_statistic: Literal[
        "mean", "median", "mean+median", "kriging", "kriging+median", "kriging+mean+median"
    ] = "mean+median"
    """The prior's statistic of the training labels, or the average of those joined by '+':
    the kernel-weighted mean; the weighted median, which resists the months with incidents and
    closures that a mean follows; kriging, a Gaussian-process regression over the rows of the
    other groups (a profile shared by all groups plus a part that varies with the group's
    closeness; needs model.prior_group), which weighs the rows by solving for them instead of
    by distance alone and so can follow a trend across a gap of several months."""

    prior_kriging_noise: float = 0.3
    """Kriging's noise variance, relative to the kernel's (1): larger = smoother, nearer the
    rows' mean; smaller = closer to the rows it interpolates."""

    prior_kriging_group_weight: float = 0.1
    """Kriging's part that varies with the group (the month), against the shared profile (1):
    its kernel is sim(other features) * (1 + this * sim(group feature))."""

    prior_width: float = 2.0
    """The prior's kernel width along a cyclic feature, in its units (months)."""

    prior_category_scale: float = 2.0
    """How alike two values of a categorical feature are for the prior: exp(-(d / scale)^2),
    d the mean absolute difference of their mean label grids, in label units."""

    prior_group: str = ""
    """A feature whose value's rows a row's prior leaves out (the fold key, e.g. month), so a
    training row's prior is what a held-out group meets; '' = leave out identical rows only."""

    ffn_mult: int = 2
    """Hidden width of the per-token MLP as a multiple of d_model."""

    def __post_init__(self) -> None:
        if self.preset != "custom" and self.options:
            # the factory's keyword arguments mean nothing to a built-in preset: the resolved
            # config, the training fingerprint and the checkpoint record none (the factory
            # itself stays: in the prediction flow it names the code a checkpoint may use)
            object.__setattr__(self, "options", FrozenMap())
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
        if self.cyclic_basis < 0:
            raise ConfigError(f"model.cyclic_basis={self.cyclic_basis} must be >= 0 (e.g. 6)")
        _in_range("model.cyclic_width", self.cyclic_width, *WIDTH, "1.5 for a month")
        self._check_prior()
        if self.context_tokens < 1:
            raise ConfigError(f"model.context_tokens={self.context_tokens} must be >= 1 (e.g. 4)")

    def _check_prior(self) -> None:
        if not 0 <= self.prior_weight <= 1:
            raise ConfigError(
                f"model.prior_weight={self.prior_weight} is outside [0, 1]; 0 = the network "
                "alone, e.g. 0.5 for an even blend"
            )
        _in_range("model.prior_width", self.prior_width, *WIDTH, "2.0 months")
        _in_range("model.prior_category_scale", self.prior_category_scale, *SCALE, "2.0")
        _in_range("model.prior_kriging_noise", self.prior_kriging_noise, *NOISE, "0.3")
        _in_range(
            "model.prior_kriging_group_weight", self.prior_kriging_group_weight, *GROUP, "0.1"
        )
        if "kriging" in self.prior_statistic and self.prior_weight > 0 and not self.prior_group:
            raise ConfigError(
                f"model.prior_statistic={self.prior_statistic!r} needs model.prior_group (the "
                "fold key, e.g. month): kriging leaves a row's own group out by solving without "
                "it; name the group, or use prior_statistic: mean+median"
            )
        if self.prior_weight > 0 and self.preset == "custom":
            raise ConfigError(
                "model.prior_weight is for the built-in presets; your own module "
                "(preset custom) decides its output itself: set model.prior_weight: 0"
            )

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
        _check_options(self.options)


def _in_range(key: str, value: float, low: float, high: float, example: str) -> None:
    if not low <= value <= high:
        raise ConfigError(
            f"{key}={value} is outside [{low:g}, {high:g}], where its arithmetic stays finite "
            f"and solvable; use e.g. {example}"
        )


def _check_options(options: Mapping[str, Any]) -> None:
    """JSON types only, at most OPTIONS_DEPTH deep and OPTIONS_BYTES as JSON."""
    _check_json("model.options", options)
    size = len(json.dumps(to_plain(options)))
    if size > OPTIONS_BYTES:
        raise ConfigError(
            f"model.options is {size} bytes as JSON, over {OPTIONS_BYTES >> 10} KiB: options "
            "are a factory's keyword arguments (sizes, flags); read bulk data in the factory"
        )


def _check_json(key: str, value: Any, depth: int = 0) -> None:
    """JSON types only (checkpoints load with weights_only=True, which takes nothing else)."""
    if isinstance(value, (Mapping, list, tuple)) and depth >= OPTIONS_DEPTH:
        raise ConfigError(
            f"{key}: model.options nest more than {OPTIONS_DEPTH} levels deep; a factory's "
            "keyword arguments need a few"
        )
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{key}: key {k!r} is not a string; quote it")
            _check_json(f"{key}.{k}", v, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(f"{key}[{i}]", v, depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value} is not finite; give a finite number")
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise ConfigError(
            f"{key}={value!r} is a {type(value).__name__}; options hold JSON types only "
            "(numbers, strings, booleans, lists, mappings)"
        )
