"""The neighbour prior: a kernel smoother over the training rows, kept inside the model.

`model.prior_weight` > 0 blends it with the network (docs/design.md, "Model quality"):

    prediction = (1 - prior_weight) * network + prior_weight * prior

The prior of a row is a statistic of the training rows' labels (`model.prior_statistic`: the
weighted mean, the weighted median, kriging, or the average of several), each training row
weighted by how close its keys are to the row's:

- a feature with a cycle (the month): a von Mises bump of width `model.prior_width` in the
  feature's units round the cycle (close to a Gaussian of that standard deviation);
- a categorical feature: a similarity learnt from the training labels when the model is built,
  exp(-(d / model.prior_category_scale)^2), d the mean absolute difference of the two values'
  mean label grids (Monday and Tuesday alike, Sunday apart; the two directions apart);
  a code outside the vocabulary, or one no training row has, is alike to every value;
- a continuous feature: a Gaussian of width one standard deviation of its training values.

Training rows that share the row's value of `model.prior_group` (the fold key: the month) are
left out, and so are training rows whose features equal the row's: a training row's prior is
what the rows of other groups say, which is what a held-out group meets. This holds at
prediction too: a row of a month the training data has is predicted from the other months.

Kriging is a Gaussian-process regression over the same similarities: kernel
k = sim(other features) * (1 + g * sim(group feature)) (g = `model.prior_kriging_group_weight`:
a profile all groups share plus a part that follows the group's closeness), noise variance
`model.prior_kriging_noise`, each cell centred on its rows' mean. `fill` solves it once per
group with that group's rows left out (and once with all rows, for a group the training data
lacks), so a prediction is a kernel row times stored coefficients: no solve in the graph.

The training rows (their raw features and labels) are buffers, filled by `fill` when
prepare-checkpoint builds the model, so that a checkpoint, an export and a served model carry
them: no data is read at prediction. No data-dependent control flow (the median is a cumulative
sum over the rows pre-sorted per cell), so torch.export and ONNX see one graph.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from enn_core.config.model import ModelConfig
from enn_core.errors import ConfigError, DataError
from enn_core.model.encoding import FeatureLayout, category_codes
from enn_core.model.layers import autocast_off

# Rows x max(cells, features) the prior may hold: a batch of 256 rows then works on at most
# 256 x 2^20 float32 (1 GiB, the median's [B, N, C]) and the buffers stay under 16 MiB x 16 B.
MAX_ROW_CELLS = 2**20
MAX_VOCAB = 1024  # values of one categorical feature: the similarity table is vocab^2
# Kriging solves a rows x rows system per group and keeps groups x rows x cells coefficients
MAX_KRIGING_ROWS = 4096
MAX_KRIGING_COEFFICIENTS = 2**23  # float32: 32 MiB
MAX_KRIGING_WORK = 2**36  # (groups + 1) x rows^3: the solves when the model is built (~a minute)


class NeighbourPrior(nn.Module):
    """Raw features [B, F] -> the prior [B, *label_shape] in real label units."""

    keys: torch.Tensor
    values: torch.Tensor
    order: torch.Tensor
    log_similarity: torch.Tensor
    kappa: torch.Tensor
    freq: torch.Tensor
    cont_std: torch.Tensor
    group_values: torch.Tensor
    kriging_mean: torch.Tensor
    kriging_coef: torch.Tensor

    def __init__(
        self,
        cfg: ModelConfig,
        layout: FeatureLayout,
        label_shape: tuple[int, ...],
        n_rows: int,
        n_groups: int = 0,
    ) -> None:
        super().__init__()
        self.statistics = tuple(cfg.prior_statistic.split("+"))
        self.kriging_noise = cfg.prior_kriging_noise
        self.kriging_group_weight = cfg.prior_kriging_group_weight
        self.category_scale = cfg.prior_category_scale
        self.label_shape = label_shape
        cells = int(np.prod(label_shape))
        if n_rows * max(cells, layout.n_features) > MAX_ROW_CELLS:
            raise ConfigError(
                f"model.prior_weight={cfg.prior_weight} keeps the {n_rows} training rows of "
                f"{cells} label cells in the model and weighs all of them for every row, over "
                f"its limit of {MAX_ROW_CELLS} row-cells; set model.prior_weight: 0 for data "
                "this large"
            )
        self.cyclic = tuple(layout.cyclic)
        self.categorical = tuple(i for i in layout.categorical if i not in layout.cyclic)
        self.vocab = tuple(
            v
            for i, v in zip(layout.categorical, layout.vocab_sizes, strict=True)
            if i not in layout.cyclic
        )
        for i, v in zip(self.categorical, self.vocab, strict=True):
            if v > MAX_VOCAB:
                raise ConfigError(
                    f"model.prior_weight: feature {layout.names[i]!r} has {v} values, over the "
                    f"neighbour prior's {MAX_VOCAB} (its similarity table is values^2); set "
                    "model.prior_weight: 0, or stage that feature as continuous"
                )
        self.continuous = tuple(layout.continuous)
        self.group = _group_index(cfg.prior_group, layout)
        self.group_rounded = self.group in layout.categorical
        periods = layout.periods
        self.register_buffer("keys", torch.zeros(n_rows, layout.n_features, dtype=torch.float64))
        self.register_buffer("values", torch.zeros(n_rows, cells))
        self.register_buffer("order", torch.zeros(n_rows, cells, dtype=torch.long))
        width = max(self.vocab, default=0) + 1
        self.register_buffer("log_similarity", torch.zeros(len(self.vocab), width, width))
        kappa = [(p / (2 * math.pi * cfg.prior_width)) ** 2 for p in periods]
        self.register_buffer("kappa", torch.tensor(kappa, dtype=torch.float64), persistent=False)
        freq = torch.tensor([2 * math.pi / p for p in periods], dtype=torch.float64)
        self.register_buffer("freq", freq, persistent=False)
        self.register_buffer("cont_std", torch.ones(len(self.continuous), dtype=torch.float64))
        if "kriging" in self.statistics:
            _check_kriging(n_rows, n_groups, cells)
            self.register_buffer("group_values", torch.zeros(n_groups, dtype=torch.float64))
            self.register_buffer("kriging_mean", torch.zeros(n_groups + 1, cells))
            self.register_buffer("kriging_coef", torch.zeros(n_groups + 1, n_rows, cells))

    @property
    def n_rows(self) -> int:
        return int(self.keys.shape[0])

    @torch.no_grad()
    def fill(self, features: np.ndarray, labels: np.ndarray) -> None:
        """Keep the training rows (raw features [N, F], labels [N, *label_shape] in real units)
        and derive what the weights need: the categorical similarities, the continuous
        features' spread, each cell's rows in label order (the median)."""
        n = self.n_rows
        if features.shape[0] != n or labels.shape[0] != n:
            raise DataError(
                f"the neighbour prior was sized for {n} training rows but got "
                f"{features.shape[0]}; re-run prepare-checkpoint"
            )
        keys = np.asarray(features, dtype=np.float64)
        values = np.asarray(labels, dtype=np.float32).reshape(n, -1)
        self.keys.copy_(torch.from_numpy(keys))
        self.values.copy_(torch.from_numpy(values))
        order = np.argsort(values, axis=0, kind="stable")
        self.order.copy_(torch.from_numpy(order))
        for j, (col, vocab) in enumerate(zip(self.categorical, self.vocab, strict=True)):
            table = self._log_similarity(keys[:, col], values, vocab)
            self.log_similarity[j, : vocab + 1, : vocab + 1] = torch.from_numpy(table)
        if self.continuous:
            spread = keys[:, list(self.continuous)].std(0)
            self.cont_std.copy_(torch.from_numpy(np.where(spread > 0, spread, 1.0)))
        if "kriging" in self.statistics:
            self._fill_kriging(keys, values)

    def _fill_kriging(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Per group: the cell means and GP coefficients of the other groups' rows (zero on the
        group's own); the last slot: all rows, for a group the training rows lack."""
        of_row = self._group_of(torch.from_numpy(keys)).numpy()
        groups = np.unique(of_row)
        if len(groups) != self.group_values.shape[0]:
            raise DataError(
                f"the neighbour prior was sized for {self.group_values.shape[0]} values of "
                f"its group feature but the training rows have {len(groups)}; re-run "
                "prepare-checkpoint"
            )
        self.group_values.copy_(torch.from_numpy(groups))
        kernel = self._kernel(self.log_similarity_parts(torch.from_numpy(keys))).numpy()
        targets = values.astype(np.float64)
        for slot, group in enumerate([*groups, None]):
            keep = np.ones(len(keys), bool) if group is None else of_row != group
            if not keep.any():  # one group only: its rows are all there is
                keep[:] = True
            mean = targets[keep].mean(0)
            system = kernel[np.ix_(keep, keep)] + self.kriging_noise * np.eye(int(keep.sum()))
            coef = np.zeros_like(targets)
            coef[keep] = _solve(system, targets[keep] - mean)
            self.kriging_mean[slot] = torch.from_numpy(mean)
            self.kriging_coef[slot] = torch.from_numpy(coef)

    def _log_similarity(self, codes: np.ndarray, values: np.ndarray, vocab: int) -> np.ndarray:
        """[vocab + 1, vocab + 1] float32: -(d / scale)^2 between the values' mean label grids
        (the log of the similarity); a value no training row has, and the unknown code (the
        last), are alike to every value (0)."""
        codes = np.round(codes).astype(np.int64)
        inside = (codes >= 0) & (codes < vocab)
        counts = np.bincount(codes[inside], minlength=vocab).astype(np.float64)
        sums = np.zeros((vocab, values.shape[1]))
        np.add.at(sums, codes[inside], values[inside])
        seen = counts > 0
        means = sums[seen] / counts[seen, None]
        table = np.zeros((vocab + 1, vocab + 1), dtype=np.float32)
        where = np.flatnonzero(seen)
        for i, a in enumerate(where):  # one row of the table at a time: memory vocab x cells
            d = np.abs(means - means[i]).mean(1)
            table[a, where] = -((d / self.category_scale) ** 2)
        return table

    def _group_of(self, x: torch.Tensor) -> torch.Tensor:
        assert self.group is not None  # callers check model.prior_group first
        return group_key(x, self.group, self.group_rounded)

    def log_similarity_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, F] raw features -> the log similarity [B, N] of each training row to each row,
        from the group feature and from all the others."""
        q, k = x.to(torch.float64)[:, None, :], self.keys[None]  # [B, 1, F], [1, N, F]
        zeros = torch.zeros(x.shape[0], self.n_rows, dtype=torch.float64, device=x.device)
        parts = {"group": zeros, "other": zeros}

        def add(col: int, log_sim: torch.Tensor) -> None:
            part = "group" if col == self.group else "other"
            parts[part] = parts[part] + log_sim

        for j, col in enumerate(self.cyclic):
            add(col, self.kappa[j] * (torch.cos((q[..., col] - k[..., col]) * self.freq[j]) - 1))
        for j, col in enumerate(self.continuous):
            add(col, -0.5 * ((q[..., col] - k[..., col]) / self.cont_std[j]) ** 2)
        for j, col in enumerate(self.categorical):
            qc = category_codes(x[:, col], self.vocab[j])
            kc = category_codes(self.keys[:, col], self.vocab[j])
            add(col, self.log_similarity[j][qc][:, kc].to(torch.float64))
        return parts["group"], parts["other"]

    def _kernel(self, parts: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Kriging's covariance [B, N] of each row with the training rows, from
        `log_similarity_parts`."""
        group, other = parts
        return torch.exp(other) * (1 + self.kriging_group_weight * torch.exp(group))

    def weights(
        self, x: torch.Tensor, parts: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """[B, F] raw features -> [B, N] weights of the training rows, summing to 1. Left-out
        rows weigh exactly 0; the nearest allowed row weighs most whatever the distances (the
        log weights are shifted by their maximum before exp); a row whose every training row is
        left out (one group only) gets the plain mean of all of them."""
        q, k = x.to(torch.float64)[:, None, :], self.keys[None]  # [B, 1, F], [1, N, F]
        group, other = self.log_similarity_parts(x) if parts is None else parts
        log_w = group + other
        out = (q == k).all(-1)
        if self.group is not None:
            out = out | (self._group_of(x)[:, None] == self._group_of(self.keys)[None])
        log_w = torch.where(out, torch.full_like(log_w, -math.inf), log_w)
        top = log_w.amax(1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        w = torch.exp(log_w - top)
        none_left = out.all(1, keepdim=True)
        w = torch.where(none_left, torch.ones_like(w), w)
        return w / w.sum(1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 under bf16/fp16 autocast too: a bf16 matmul would round 100 km/h to 0.5 km/h
        with autocast_off(x.device.type):
            return self._prior(x)

    def _prior(self, x: torch.Tensor) -> torch.Tensor:
        similarity = self.log_similarity_parts(x)  # once for every statistic
        parts = []
        if "kriging" in self.statistics:
            parts.append(self._kriging(x, similarity))
        if "mean" in self.statistics or "median" in self.statistics:
            w = self.weights(x, similarity).to(torch.float32)  # [B, N]
        if "mean" in self.statistics:
            parts.append(w @ self.values)
        if "median" in self.statistics:
            ranked = w[:, self.order]  # [B, N, C]: each cell's rows in label order
            below = torch.cumsum(ranked, dim=1) >= 0.5
            pos = below.to(torch.float32).argmax(dim=1, keepdim=True)  # first to reach half
            ranked_values = torch.gather(self.values, 0, self.order)  # [N, C] sorted per cell
            rows = ranked_values.expand(x.shape[0], -1, -1)
            parts.append(torch.gather(rows, 1, pos).squeeze(1))
        out = torch.stack(parts).mean(0)
        return out.reshape((-1, *self.label_shape))

    def _kriging(
        self, x: torch.Tensor, similarity: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """[B, C]: the solve without the row's own group (the all-rows solve for a group the
        training rows lack) applied to its kernel row."""
        same = self._group_of(x)[:, None] == self.group_values[None]  # [B, G]
        slot = torch.where(
            same.any(1),
            same.to(torch.float32).argmax(1),
            torch.full_like(same[:, 0], self.group_values.shape[0], dtype=torch.long),
        )
        kernel = self._kernel(similarity).to(torch.float32)  # [B, N]
        coef = self.kriging_coef[slot]  # [B, N, C]
        return self.kriging_mean[slot] + torch.bmm(kernel[:, None, :], coef).squeeze(1)


def _solve(system: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Kriging's coefficients; a singular or non-finite solve is one line, not a traceback
    (ModelConfig's ranges keep the noise and group weight where it does not happen)."""
    try:
        coef: np.ndarray | None = np.linalg.solve(system, targets)
    except np.linalg.LinAlgError:
        coef = None
    if coef is None or not np.isfinite(coef).all():
        raise ConfigError(
            "kriging's solve for the neighbour prior has no finite solution with these rows; "
            "raise model.prior_kriging_noise (e.g. 0.3) or lower "
            "model.prior_kriging_group_weight (e.g. 0.1)"
        )
    return coef


def _check_kriging(n_rows: int, n_groups: int, cells: int) -> None:
    if (
        n_rows > MAX_KRIGING_ROWS
        or (n_groups + 1) * n_rows * cells > MAX_KRIGING_COEFFICIENTS
        or (n_groups + 1) * n_rows**3 > MAX_KRIGING_WORK
    ):
        raise ConfigError(
            f"model.prior_statistic with kriging solves for the {n_rows} training rows once per "
            f"value of model.prior_group ({n_groups} values) and keeps {cells} coefficients per "
            f"row each, over its limits ({MAX_KRIGING_ROWS} rows, {MAX_KRIGING_COEFFICIENTS} "
            f"coefficients, {MAX_KRIGING_WORK} for groups x rows^3); use a group key with few "
            "values (the fold key), or model.prior_statistic: mean+median"
        )


def group_count(features: np.ndarray, cfg: ModelConfig, layout: FeatureLayout) -> int:
    """How many values of the group feature the training rows have (kriging's solves)."""
    if "kriging" not in cfg.prior_statistic:
        return 0
    col = _group_index(cfg.prior_group, layout)
    assert col is not None  # ModelConfig refuses kriging without model.prior_group
    keys = group_key(torch.from_numpy(np.asarray(features)), col, col in layout.categorical)
    return len(torch.unique(keys))


def group_key(x: torch.Tensor, col: int, rounded: bool) -> torch.Tensor:
    """[B] the group feature's values; a categorical one rounded as its codes are (a month
    sent as 2.0000001 is month 2, and its rows are left out)."""
    value = x.to(torch.float64)[:, col]
    return torch.round(value) if rounded else value


def _group_index(name: str, layout: FeatureLayout) -> int | None:
    if not name:
        return None
    if name not in layout.names:
        raise ConfigError(
            f"model.prior_group={name!r} is not a feature of the staged data "
            f"({list(layout.names)}); name the feature whose rows a held-out group lacks "
            "(the fold key), or set it to ''"
        )
    return layout.names.index(name)
