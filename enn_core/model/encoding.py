"""Feature encoding inside the model: the raw staged feature vector in, one dense vector out.

The staged `features.npy` holds raw values (docs/design.md): continuous values as they are,
categorical features as integer codes into the manifest vocabulary, cyclic features as the
raw periodic value. Encoding lives here so that an exported model takes the same raw vector:

- continuous: z-score with the manifest's train-split mean/std (std floored), computed in
  float64 so wide-range inputs (timestamps) keep their precision, then cast to float32;
- categorical: an embedding per feature; a code outside the vocabulary maps to an extra
  "unknown" row (no data-dependent branch, so torch.export and ONNX see one graph);
- cyclic (any spec with `cyclic_period`, or kind "cyclic"): sin and cos of
  2*pi*(value - cyclic_offset)/cyclic_period (offset 0 when absent; a categorical cyclic
  key stores its code, so its offset is 0).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from enn_core.errors import DataError

STD_FLOOR = 1e-6  # floor on tiny std: a constant feature must not blow up to inf
REL_FLOOR = 1e-9  # ... and relative to |mean|, far above float64 rounding of the mean
KINDS = ("continuous", "categorical", "cyclic")


@dataclass(frozen=True)
class FeatureLayout:
    """Which raw columns get which encoding (derived once from the manifest's feature_specs)."""

    continuous: tuple[int, ...]
    cont_mean: tuple[float, ...]
    cont_std: tuple[float, ...]
    categorical: tuple[int, ...]
    vocab_sizes: tuple[int, ...]
    cyclic: tuple[int, ...]
    periods: tuple[float, ...]
    offsets: tuple[float, ...]
    names: tuple[str, ...]

    @property
    def n_features(self) -> int:
        return len(self.names)


def without_cyclic_embeddings(layout: FeatureLayout) -> FeatureLayout:
    """The layout with the categorical features that are also cyclic (a month) encoded by
    their sin/cos only (`model.cyclic_embeddings: false`)."""
    keep = [j for j, i in enumerate(layout.categorical) if i not in layout.cyclic]
    return dataclasses.replace(
        layout,
        categorical=tuple(layout.categorical[j] for j in keep),
        vocab_sizes=tuple(layout.vocab_sizes[j] for j in keep),
    )


def floor_std(std: float, scale: float = 1.0) -> float:
    """A std safe to divide by: at least max(STD_FLOOR, REL_FLOOR * |scale|)."""
    floor = max(STD_FLOOR, REL_FLOOR * abs(scale))
    return float(std) if math.isfinite(std) and std > floor else floor


def parse_feature_specs(specs: Sequence[Mapping[str, Any]]) -> FeatureLayout:
    """Validate the manifest's feature_specs and group the columns by encoding."""
    if not specs:
        raise DataError(
            "manifest feature_specs is empty; "
            "the model needs at least one feature (re-run stage-data)"
        )
    cont, cmean, cstd, cat, vsz, cyc, per, off, names = [], [], [], [], [], [], [], [], []
    for i, spec in enumerate(specs):
        name = str(spec.get("name", f"#{i}"))
        kind = spec.get("kind")
        if kind not in KINDS:
            raise DataError(
                f"manifest feature_specs[{i}] ({name}): kind={kind!r}; "
                f"expected one of {KINDS} (re-run stage-data)"
            )
        names.append(name)
        if kind == "continuous":
            if "mean" not in spec or "std" not in spec:
                raise DataError(
                    f"manifest feature_specs[{i}] ({name}): "
                    "continuous feature lacks mean/std (re-run stage-data)"
                )
            cont.append(i)
            cmean.append(float(spec["mean"]))
            cstd.append(floor_std(float(spec["std"]), float(spec["mean"])))
        elif kind == "categorical":
            vocab = spec.get("vocab")
            if not vocab:
                raise DataError(
                    f"manifest feature_specs[{i}] ({name}): "
                    "categorical feature has no vocab (re-run stage-data)"
                )
            cat.append(i)
            vsz.append(len(vocab))
        period = spec.get("cyclic_period")
        if kind == "cyclic" and not period:
            raise DataError(
                f"manifest feature_specs[{i}] ({name}): "
                "kind=cyclic needs cyclic_period > 0 (re-run stage-data)"
            )
        if period:
            if float(period) <= 0:
                raise DataError(
                    f"manifest feature_specs[{i}] ({name}): cyclic_period={period} must be > 0"
                )
            cyc.append(i)
            per.append(float(period))
            off.append(float(spec.get("cyclic_offset") or 0.0))
    return FeatureLayout(
        tuple(cont),
        tuple(cmean),
        tuple(cstd),
        tuple(cat),
        tuple(vsz),
        tuple(cyc),
        tuple(per),
        tuple(off),
        tuple(names),
    )


def category_codes(values: torch.Tensor, vocab: torch.Tensor | int) -> torch.Tensor:
    """Raw categorical values -> long codes; a code outside [0, vocab) maps to `vocab`, the
    "unknown" row (no data-dependent branch). `vocab` broadcasts against `values`."""
    codes = torch.round(values.to(torch.float64)).to(torch.long)
    vocab = torch.as_tensor(vocab, device=codes.device).expand_as(codes)
    return torch.where((codes < 0) | (codes >= vocab), vocab, codes)


class FeatureEncoder(nn.Module):
    """Raw features [B, F] -> encoded vector [B, out_dim] (float32) and per-feature tokens."""

    # Buffers (register_buffer below), declared so they type as tensors, not Tensor | Module.
    cont_idx: torch.Tensor
    cat_idx: torch.Tensor
    cyc_idx: torch.Tensor
    cont_mean: torch.Tensor
    cont_std: torch.Tensor
    cyc_offset: torch.Tensor
    cyc_freq: torch.Tensor
    cyc_centres: torch.Tensor
    cyc_kappa: torch.Tensor
    vocab_sizes: torch.Tensor

    def __init__(
        self,
        layout: FeatureLayout,
        embed_dim: int,
        feature_dropout: float = 0.0,
        cyclic_basis: int = 0,
        cyclic_width: float = 1.5,
    ) -> None:
        super().__init__()
        self.layout = layout
        self.feature_dropout = feature_dropout
        self.embed_dim = embed_dim
        idx = lambda t: torch.tensor(t, dtype=torch.long)  # noqa: E731
        self.register_buffer("cont_idx", idx(layout.continuous), persistent=False)
        self.register_buffer("cat_idx", idx(layout.categorical), persistent=False)
        self.register_buffer("cyc_idx", idx(layout.cyclic), persistent=False)
        self.register_buffer("cont_mean", torch.tensor(layout.cont_mean, dtype=torch.float64))
        self.register_buffer("cont_std", torch.tensor(layout.cont_std, dtype=torch.float64))
        self.register_buffer("cyc_offset", torch.tensor(layout.offsets, dtype=torch.float64))
        self.register_buffer(
            "cyc_freq", torch.tensor([2 * math.pi / p for p in layout.periods], dtype=torch.float64)
        )
        self.register_buffer("vocab_sizes", idx(layout.vocab_sizes), persistent=False)
        # cyclic_basis K > 0: von Mises bumps exp(kappa * (cos(angle - centre_k) - 1)) at K
        # evenly spaced centres; kappa from the width in the feature's units (1 / sigma^2 in
        # radians, so a bump is close to a Gaussian of that width round the cycle).
        self.cyclic_basis = cyclic_basis
        centres = [2 * math.pi * k / cyclic_basis for k in range(cyclic_basis)]
        kappa = [(p / (2 * math.pi * cyclic_width)) ** 2 for p in layout.periods]
        self.register_buffer(
            "cyc_centres", torch.tensor(centres, dtype=torch.float64), persistent=False
        )
        self.register_buffer(
            "cyc_kappa", torch.tensor(kappa, dtype=torch.float64), persistent=False
        )
        # One extra row per table: codes outside the vocabulary ("unknown").
        embeddings = [nn.Embedding(v + 1, embed_dim) for v in layout.vocab_sizes]
        # Zero init: a category the training rows never had (e.g. a held-out month, whose
        # code exists because the vocabulary spans the period) stays neutral instead of
        # feeding a random vector; seen categories move away from zero with their gradients.
        for emb in embeddings:
            nn.init.zeros_(emb.weight)
        self.embeddings = nn.ModuleList(embeddings)
        per_cycle = cyclic_basis if cyclic_basis > 0 else 2
        self.out_dim = (
            len(layout.continuous)
            + embed_dim * len(layout.categorical)
            + per_cycle * len(layout.cyclic)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Feature dropout (training only): a dropped feature's encoding is zero, which is what
        # an unseen category looks like (zero-init embedding), so the model learns a sensible
        # prediction for it. Eval and export never take this branch.
        keep = None
        if self.training and self.feature_dropout > 0:
            keep = (
                torch.rand(x.shape[0], self.layout.n_features, device=x.device)
                >= self.feature_dropout
            ).float()
        parts = []
        if self.layout.continuous:
            raw = x.index_select(1, self.cont_idx).to(torch.float64)
            z = ((raw - self.cont_mean) / self.cont_std).to(torch.float32)
            parts.append(z if keep is None else z * keep.index_select(1, self.cont_idx))
        if self.layout.categorical:
            codes = category_codes(x.index_select(1, self.cat_idx), self.vocab_sizes)
            for j, emb in enumerate(self.embeddings):
                e = emb(codes[:, j]).to(torch.float32)
                parts.append(e if keep is None else e * keep[:, self.layout.categorical[j], None])
        if self.layout.cyclic:
            angle = (
                x.index_select(1, self.cyc_idx).to(torch.float64) - self.cyc_offset
            ) * self.cyc_freq
            if self.cyclic_basis > 0:  # [B, C, K] -> [B, C * K], feature-major
                near = torch.cos(angle[:, :, None] - self.cyc_centres) - 1
                sc = torch.exp(self.cyc_kappa[:, None] * near).flatten(1).to(torch.float32)
                per_cycle = self.cyclic_basis
                if keep is not None:
                    sc = sc * keep.index_select(1, self.cyc_idx).repeat_interleave(per_cycle, 1)
            else:
                sc = torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).to(torch.float32)
                if keep is not None:
                    sc = sc * keep.index_select(1, self.cyc_idx).repeat(1, 2)
            parts.append(sc)
        return torch.cat(parts, dim=1)
