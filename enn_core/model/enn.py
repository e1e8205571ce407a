"""The ENN model: raw feature vector in, a label-shaped tensor out; the presets.

- `model(x)`: x float32/float64 [B, F] raw features -> [B, *label_shape] in normalized label
  units (the training path; the loss is computed there).
- `model.predict(x)`: real units (label mean/std are buffers of the model, std floored).
- `model.blocks`: the nn.ModuleList FSDP2 shards block by block. Nothing here knows of ranks.

Presets:
- `tabular`: encoded features -> residual MLP blocks -> fp32 head emitting the flattened
  label, reshaped to label_shape (any label shape).
- `spatiotemporal` (label_shape [S, T]): every section and every hour has its own learned
  embedding; their sum gives one token per cell [B, S, T, d], conditioned on the sample's
  features by FiLM (every block) and/or cross-attention to context tokens; blocks attend
  along the section axis then along the hour axis; an fp32 tail gives one value per cell:
  head(token) + a learned per-cell bias + a per-cell linear read-out of the context vector.
No data-dependent control flow: torch.export (dynamic batch) and ONNX see one graph.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any, get_args

import numpy as np
import torch
from torch import nn

from enn_core.config.model import ModelConfig, Preset
from enn_core.data.dataset import StagedDataset
from enn_core.data.manifest import DataSpec, StagedManifest
from enn_core.errors import ConfigError, DataError
from enn_core.model.custom import build_body, describe_body, model_spec
from enn_core.model.encoding import (
    FeatureEncoder,
    floor_std,
    parse_feature_specs,
    without_cyclic_embeddings,
)
from enn_core.model.layers import MLP, FP32Head, ResidualBlock, SpatioTemporalBlock, autocast_off
from enn_core.model.prior import NeighbourPrior, group_count
from enn_core.model_code import BUILTIN, ModelCode


@dataclass(frozen=True)
class PriorSize:
    """The neighbour prior's size: the training rows it keeps and the groups it solves for
    (read from the staged data, or from a checkpoint's weights)."""

    rows: int
    groups: int = 0


class ENN(nn.Module):
    """Base: feature encoder, label statistics, predict(); presets implement `trunk`."""

    preset = "base"
    # Declared for the type checker: buffers registered below, blocks set by each preset.
    label_mean: torch.Tensor
    label_std: torch.Tensor
    blocks: nn.ModuleList

    def __init__(
        self,
        cfg: ModelConfig,
        data: DataSpec,
        label_mean: np.ndarray,
        label_std: np.ndarray,
        prior: PriorSize | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.label_shape = data.label_shape
        self.feature_names = parse_feature_specs(data.feature_specs).names
        layout = parse_feature_specs(data.feature_specs)
        if not cfg.cyclic_embeddings:
            layout = without_cyclic_embeddings(layout)
        self.encoder = FeatureEncoder(
            layout, cfg.embed_dim, cfg.feature_dropout, cfg.cyclic_basis, cfg.cyclic_width
        )
        self.register_buffer("label_mean", torch.as_tensor(label_mean, dtype=torch.float32))
        self.register_buffer("label_std", torch.as_tensor(label_std, dtype=torch.float32))
        self.prior: NeighbourPrior | None = None
        if cfg.prior_weight > 0:
            size = prior or PriorSize(0)
            self.prior = NeighbourPrior(
                cfg, parse_feature_specs(data.feature_specs), self.label_shape, *astuple(size)
            )

    @property
    def n_features(self) -> int:
        return len(self.feature_names)

    def trunk(self, enc: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Raw features [B, F] -> normalized label units [B, *label_shape] (float32); with a
        neighbour prior, the blend (the network alone while training with prior_train false)."""
        net = self.trunk(self.encoder(x))
        if self.prior is None or (self.training and not self.cfg.prior_train):
            return net
        w = self.cfg.prior_weight
        return (1 - w) * net.float() + w * self.normalize(self.prior(x))

    def denormalize(self, y: torch.Tensor) -> torch.Tensor:
        return y.float() * self.label_std + self.label_mean

    def normalize(self, y: torch.Tensor) -> torch.Tensor:
        return (y.float() - self.label_mean) / self.label_std

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Raw features [B, F] -> real label units [B, *label_shape]."""
        return self.denormalize(self.forward(x))

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for logs and run records."""
        lay = self.encoder.layout
        return {
            "preset": self.preset,
            "parameters": sum(p.numel() for p in self.parameters()),
            "d_model": self.cfg.d_model,
            "layers": len(self.blocks),
            "heads": self.cfg.heads,
            "conditioning": self.cfg.conditioning if self.preset == "spatiotemporal" else None,
            "label_shape": list(self.label_shape),
            "prior": None
            if self.prior is None
            else {
                "weight": self.cfg.prior_weight,
                "statistic": self.cfg.prior_statistic,
                "training_rows": self.prior.n_rows,
            },
            "features": {
                "total": lay.n_features,
                "continuous": [lay.names[i] for i in lay.continuous],
                "categorical": {
                    lay.names[i]: v for i, v in zip(lay.categorical, lay.vocab_sizes, strict=True)
                },
                "cyclic": {lay.names[i]: p for i, p in zip(lay.cyclic, lay.periods, strict=True)},
                "encoded_dim": self.encoder.out_dim,
            },
        }


class TabularENN(ENN):
    preset = "tabular"

    def __init__(
        self,
        cfg: ModelConfig,
        data: DataSpec,
        label_mean: np.ndarray,
        label_std: np.ndarray,
        prior: PriorSize | None = None,
    ) -> None:
        super().__init__(cfg, data, label_mean, label_std, prior)
        d = cfg.d_model
        self.stem = nn.Linear(self.encoder.out_dim, d)
        self.blocks = nn.ModuleList(
            ResidualBlock(d, cfg.ffn_mult, cfg.dropout) for _ in range(cfg.layers)
        )
        self.head = FP32Head(d, int(np.prod(self.label_shape)))

    def trunk(self, enc: torch.Tensor) -> torch.Tensor:
        h = self.stem(enc)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h).reshape((-1, *self.label_shape))


class SpatioTemporalENN(ENN):
    preset = "spatiotemporal"

    def __init__(
        self,
        cfg: ModelConfig,
        data: DataSpec,
        label_mean: np.ndarray,
        label_std: np.ndarray,
        prior: PriorSize | None = None,
    ) -> None:
        super().__init__(cfg, data, label_mean, label_std, prior)
        d = cfg.d_model
        s, t = self.label_shape
        film, cross = "film" in cfg.conditioning, "cross" in cfg.conditioning
        self.context = MLP(self.encoder.out_dim, d, cfg.dropout, d_out=d)
        self.section_embed = nn.Parameter(torch.randn(s, d) * 0.02)
        self.hour_embed = nn.Parameter(torch.randn(t, d) * 0.02)
        self.film = nn.Linear(d, 2 * d)  # conditions the initial tokens on the sample
        self.context_tokens = nn.Linear(d, cfg.context_tokens * d) if cross else None
        self.blocks = nn.ModuleList(
            SpatioTemporalBlock(d, cfg.heads, cfg.ffn_mult, cfg.dropout, cross=cross, film=film)
            for _ in range(cfg.layers)
        )
        self.head = FP32Head(d, 1)
        self.cell_bias = nn.Parameter(torch.zeros(s, t))
        # A direct per-cell linear read-out of the sample's context: lets each cell learn how
        # the keys (day type, direction, ...) shift it without going through attention.
        self.cell_readout = nn.Parameter(torch.zeros(s, t, d))

    def trunk(self, enc: torch.Tensor) -> torch.Tensor:
        c = self.context(enc)  # [B, d]
        shift, scale = self.film(c).chunk(2, dim=-1)
        grid = self.section_embed[:, None, :] + self.hour_embed[None, :, :]  # [S, T, d]
        x = grid[None] * (1 + scale[:, None, None, :]) + shift[:, None, None, :]
        ctx = None
        if self.context_tokens is not None:
            ctx = self.context_tokens(c).reshape(c.shape[0], self.cfg.context_tokens, c.shape[1])
        for blk in self.blocks:
            x = blk(x, c, ctx)
        out = self.head(x).squeeze(-1)
        with autocast_off(c.device.type):  # the read-out is part of the fp32 tail
            return out + self.cell_bias + torch.einsum("bd,std->bst", c.float(), self.cell_readout)


class CustomENN(ENN):
    """Your own module (enn_core.model.custom) inside the pipeline's encoder and label
    statistics: the same forward/predict contract as the presets."""

    preset = "custom"

    def __init__(
        self,
        cfg: ModelConfig,
        data: DataSpec,
        label_mean: np.ndarray,
        label_std: np.ndarray,
        code: ModelCode,
    ) -> None:
        super().__init__(cfg, data, label_mean, label_std)
        spec = model_spec(data, self.encoder)
        self.body, self.raw_features = build_body(cfg, spec, code, self.n_features)

    @property
    def blocks(self) -> nn.ModuleList:  # type: ignore[override]  # read-only: the body's own
        """FSDP2's units: the module's own `blocks`, or none (the whole model is one unit)."""
        blocks = getattr(self.body, "blocks", None)
        return blocks if isinstance(blocks, nn.ModuleList) else nn.ModuleList()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs = x.float() if self.raw_features else self.encoder(x)
        return self.body(inputs).float()

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        custom = {"factory": self.cfg.factory, "options": dict(self.cfg.options)}
        return {**out, "d_model": None, "heads": None, **custom, **describe_body(self.body)}


def label_statistics(
    data: DataSpec, data_dir: str | Path | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Label mean/std broadcast to label_shape, std floored; per-cell files when declared."""
    shape = data.label_shape
    stats = data.label_stats
    if "mean" not in stats or "std" not in stats:
        raise DataError("manifest label_stats lacks mean/std; re-run stage-data")
    mean = np.asarray(stats["mean"], dtype=np.float64)
    std = np.asarray(stats["std"], dtype=np.float64)
    for key in ("cell_mean_file", "cell_std_file"):
        name = stats.get(key)
        if not name:
            continue
        if data_dir is None:
            raise DataError(
                f"manifest label_stats.{key}={name} but no data_dir was given to build_model"
            )
        arr = np.load(Path(data_dir) / name).astype(np.float64)
        if key == "cell_mean_file":
            mean = arr
        else:
            std = arr
    try:
        mean = np.broadcast_to(mean, shape).copy()
        std = np.broadcast_to(std, shape).copy()
    except ValueError as e:
        raise DataError(
            f"manifest label_stats do not broadcast to label_shape {list(shape)}; re-run stage-data"
        ) from e
    floors = np.vectorize(floor_std)(std, mean) if std.size else std
    return mean.astype(np.float32), np.asarray(floors, dtype=np.float32)


def check_fit(cfg: ModelConfig, data: DataSpec) -> None:
    """Config x data checks that only make sense together; messages name the fix."""
    if cfg.preset not in BUILDERS:
        raise ConfigError(f"model.preset={cfg.preset!r} is unknown; use one of {list(PRESETS)}")
    shape = list(data.label_shape)
    if not shape or any(int(s) < 1 for s in shape):
        raise DataError(
            f"manifest label_shape={shape} must be non-empty with sizes >= 1; re-run stage-data"
        )
    if cfg.preset == "spatiotemporal" and len(shape) != 2:
        raise ConfigError(
            "model.preset=spatiotemporal needs a 2-D label_shape [sections, hours] "
            f"but the data has {shape}; "
            "set data.label_shape to two axes or use model.preset=tabular"
        )


# How each preset is built: (config, data spec, label mean, label std, prior size, code).
Builder = Callable[
    [ModelConfig, DataSpec, np.ndarray, np.ndarray, PriorSize | None, ModelCode], ENN
]
BUILDERS: dict[str, Builder] = {
    "tabular": lambda cfg, data, mean, std, prior, code: TabularENN(cfg, data, mean, std, prior),
    "spatiotemporal": lambda cfg, data, mean, std, prior, code: SpatioTemporalENN(
        cfg, data, mean, std, prior
    ),
    "custom": lambda cfg, data, mean, std, prior, code: CustomENN(cfg, data, mean, std, code),
}
PRESETS = tuple(BUILDERS)
if set(PRESETS) != set(get_args(Preset)):  # a preset the config accepts is one built here
    raise ImportError(
        f"model presets of ModelConfig.preset {sorted(get_args(Preset))} and the builders in "
        f"enn_core/model/enn.py {sorted(PRESETS)} differ; add the builder to BUILDERS"
    )


def _data_spec(data: DataSpec | StagedManifest | Mapping[str, Any]) -> DataSpec:
    """The data spec of a manifest, or of a mapping (the JSON form of either)."""
    if isinstance(data, DataSpec):
        return data
    if isinstance(data, StagedManifest):
        return data.data_spec()
    for key in ("label_shape", "feature_specs"):
        if key not in data:
            raise DataError(f"manifest has no {key!r}; re-run stage-data")
    return DataSpec.of(data)


def build_model(
    cfg: ModelConfig,
    data: DataSpec | StagedManifest | Mapping[str, Any],
    *,
    data_dir: str | Path | None = None,
    code: ModelCode = BUILTIN,
    where: str = "model",
    prior: PriorSize | None = None,
) -> ENN:
    """The model for `data` (the staged manifest, its `data_spec()`, a checkpoint's, or the
    JSON form of either), initialised from `cfg.init_seed` (global RNG untouched). A custom
    model's factory is imported only when `code` (the params in use) allows it. With a
    neighbour prior (model.prior_weight > 0) its training rows are read from `data_dir` unless
    `prior` gives their size (a checkpoint's weights then bring them)."""
    spec = _data_spec(data)
    check_fit(cfg, spec)
    mean, std = label_statistics(spec, data_dir)
    training = None
    if cfg.prior_weight > 0 and (prior is None or not prior.rows):
        training = prior_rows(data_dir, cfg.prior_group)
        layout = parse_feature_specs(spec.feature_specs)
        prior = PriorSize(training[0].shape[0], group_count(training[0], cfg, layout))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        if cfg.preset == "custom":
            code.allow(cfg.factory, where)
        model = BUILDERS[cfg.preset](cfg, spec, mean, std, prior, code)
    if training is not None and model.prior is not None:
        model.prior.fill(*training)
    return model


def prior_rows(data_dir: str | Path | None, group: str = "") -> tuple[np.ndarray, np.ndarray]:
    """The raw features and labels the neighbour prior keeps: the training split's, and the
    validation split's too unless that would let a validation row see its own held-out group.
    Validation rows drawn from the training groups are safe (the prior already holds their
    groups' other rows), and so are whole validation groups (`data.val_fold`,
    `data.val_by_key`) when `group` (model.prior_group) is the fold key, which a row's prior
    leaves out; whole validation groups with another or no group stay out of the prior, so
    validation still measures what a held-out group meets. The test rows are never read."""
    if data_dir is None:
        raise ConfigError(
            "model.prior_weight > 0 keeps the training rows in the model, but it is built "
            "without the staged data; build it through prepare-checkpoint, or set "
            "model.prior_weight: 0"
        )
    ds = StagedDataset(data_dir)
    split = ds.manifest.split_definition
    whole_groups = split.get("val_by_key") or int(split.get("val_fold", -1)) >= 0
    names = ["train"]
    if "val" in ds.split_names and (not whole_groups or group == split.get("fold_key")):
        names.append("val")
    rows = np.sort(np.concatenate([np.asarray(ds.split(name)) for name in names]))
    return np.asarray(ds.features[rows]), np.asarray(ds.targets[rows])
