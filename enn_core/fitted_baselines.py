"""What a practitioner tries first, scored by validate beside the model on the same rows:

- `ridge`: RidgeCV (alpha by generalized cross-validation) on the encoded features (one-hot
  categoricals, sin/cos of cyclic values, z-scored numbers: the encoding the model starts
  from, with one-hot in place of learned embeddings), one linear model per output cell;
- `gbt`: scikit-learn's HistGradientBoostingRegressor in long format: one sample per row and
  output cell, the raw features plus the cell's position on each label axis, categorical
  columns as categories (early stopping on a held-out tenth of the samples).

Both fit on the training split only, for the metric validate reports (MAE): each is fitted
with the absolute-error loss (`ridge`: the same encoding and penalty, iteratively reweighted
towards least absolute deviations; `gbt`: `loss="absolute_error"`) and with squared error, and
the squared-error fit is kept only when its MAE on the validation rows is lower; `BaselineFit.loss`
and the detail say which ran and both validation MAEs (chosen on the validation rows, so the
test rows stay unseen). They must not slow every run: a fit is cached per data
fingerprint (features, labels and splits), baseline and settings under
`<work>/cache/baselines/`, and capped: more than `validate.baseline_max_rows` training samples
are subsampled (seeded), and each of gbt's two fits stops adding trees at
`validate.baseline_time_s`; each `BaselineFit` says what was used. The champion rule does not
look at them (it keeps its naive-predictor gate); validate reports them.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from enn_core.atomic import atomic_dir, write_json
from enn_core.config.stages import ValidateConfig
from enn_core.data.dataset import StagedDataset
from enn_core.model.encoding import FeatureLayout, parse_feature_specs

FORMAT = 2  # bump when a baseline's definition changes: the cache keys change with it
LOSSES = ("absolute_error", "squared_error")  # the metric's loss first: kept on a tie
L1_ITERATIONS = 30  # ridge's reweighting steps towards least absolute deviations
L1_CELLS = 50_000_000  # ridge's L1 variant: at most outputs x features^2 normal-equation numbers
SEED = 0
GBT_STEP = 25  # trees added between two looks at the clock
GBT_MAX_ITER = 300
ENCODED_CELLS = 20_000_000  # ridge: at most this many encoded numbers in memory (float32)
CATEGORY_LIMIT = 254  # HistGradientBoosting's categories must stay below max_bins (255)


@dataclass(frozen=True)
class BaselineFit:
    """How one baseline was fitted (the metrics files and the Prefect table show it)."""

    name: str
    fit_s: float  # seconds of the fit that produced these predictions (cached or not)
    samples: int  # training samples used (gbt: rows x output cells)
    available: int  # training samples there were
    detail: str  # alpha (ridge); trees and why it stopped (gbt); the losses' validation MAEs
    cached: bool  # read from the cache in this run
    loss: str = ""  # the loss of the fit kept: absolute_error or squared_error

    @property
    def subsampled(self) -> bool:
        return self.samples < self.available


@dataclass(frozen=True)
class BaselineResult:
    fit: BaselineFit
    predictions: Mapping[str, np.ndarray]  # split -> [rows, *label_shape], real units


def encode(features: np.ndarray, layout: FeatureLayout) -> np.ndarray:
    """[N, F] raw staged features -> [N, D] float32: z-scored numbers, one-hot categoricals (an
    unknown or missing code is all zeros), sin and cos of cyclic values."""
    x = np.asarray(features, dtype=np.float64)
    cols: list[np.ndarray] = []
    for i, mean, std in zip(layout.continuous, layout.cont_mean, layout.cont_std, strict=True):
        cols.append(((x[:, i] - mean) / std)[:, None])
    for i, size in zip(layout.categorical, layout.vocab_sizes, strict=True):
        cols.append(x[:, i, None] == np.arange(size)[None, :])
    for i, period, offset in zip(layout.cyclic, layout.periods, layout.offsets, strict=True):
        angle = 2 * np.pi * (x[:, i] - offset) / period
        cols.append(np.stack([np.sin(angle), np.cos(angle)], axis=1))
    out = np.concatenate([c.astype(np.float32) for c in cols], axis=1)
    return np.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0)


def _sample(n: int, cap: int, rng: np.random.Generator) -> np.ndarray:
    return np.arange(n) if n <= cap else np.sort(rng.choice(n, cap, replace=False))


def fit_ridge(
    ds: StagedDataset, splits: Sequence[str], cfg: ValidateConfig
) -> tuple[dict[str, np.ndarray], BaselineFit]:
    from sklearn.linear_model import RidgeCV

    layout = parse_feature_specs(ds.feature_specs)
    train = np.asarray(ds.split("train"))
    width = encode(ds.features[:1], layout).shape[1]
    cap = max(100, min(cfg.baseline_max_rows, ENCODED_CELLS // max(width, 1)))
    rows = train[_sample(len(train), cap, np.random.default_rng(SEED))]
    y = np.asarray(ds.targets[rows], dtype=np.float64)
    flat = y.reshape(len(y), -1)
    t0 = time.perf_counter()
    x = encode(ds.features[rows], layout).astype(np.float64)
    model = RidgeCV(alphas=np.logspace(-3, 3, 13)).fit(x, flat)
    alpha = float(model.alpha_)
    # [1 + features, outputs]: the intercept row, then the weights (y is always 2-D here)
    coef = {
        "squared_error": np.vstack(
            [np.atleast_1d(model.intercept_)[None], np.atleast_2d(model.coef_).T]
        )
    }
    note = ""
    if flat.shape[1] * (width + 1) ** 2 <= L1_CELLS:
        coef["absolute_error"] = _l1_ridge(x, flat, alpha, coef["squared_error"])
    else:
        note = "; its least-absolute-deviation fit skipped (too many outputs x features)"
    seconds = time.perf_counter() - t0

    def predict(c: np.ndarray, split: str) -> np.ndarray:
        idx = np.asarray(ds.split(split))
        xs = encode(ds.features[idx], layout).astype(np.float64)
        return (c[0] + xs @ c[1:]).reshape(len(idx), *y.shape[1:])

    loss, detail = _keep(ds, {k: predict(c, "val") for k, c in coef.items()})
    preds = {split: predict(coef[loss], split).astype(np.float32) for split in splits}
    detail = f"alpha {alpha:.3g}, {width} encoded features, {detail}{note}"
    return preds, BaselineFit("ridge", seconds, len(rows), len(train), detail, False, loss)


def _l1_ridge(x: np.ndarray, y: np.ndarray, alpha: float, start: np.ndarray) -> np.ndarray:
    """Ridge towards least absolute deviations, one per output column: iteratively reweighted
    least squares (weights 1 / |residual|, floored), the intercept unpenalized, the penalty
    rescaled from squared to absolute error by the least-squares fit's median |residual|.
    Returns [1 + features, outputs] like `start` (the least-squares fit it starts from)."""
    xi = np.column_stack([np.ones(len(x)), x])
    coef = start.copy()
    resid = np.abs(y - xi @ coef)
    scale = max(float(np.median(resid)), 1e-12)
    penalty = np.eye(xi.shape[1]) * alpha / scale
    penalty[0, 0] = 0.0
    for _ in range(L1_ITERATIONS):
        w = 1.0 / np.maximum(resid, 1e-3 * scale)  # [n, outputs]
        gram = np.einsum("ni,nk,nj->kij", xi, w, xi) + penalty  # [outputs, d, d]
        rhs = np.einsum("ni,nk->ki", xi, w * y)  # [outputs, d]
        coef = np.linalg.solve(gram, rhs[..., None])[..., 0].T
        resid = np.abs(y - xi @ coef)
    return coef


def _keep(ds: StagedDataset, val_preds: Mapping[str, np.ndarray]) -> tuple[str, str]:
    """The loss whose fit has the lower MAE on the validation rows (the absolute error's on a
    tie, or when there are no validation rows), and the detail naming both."""
    rows = np.asarray(ds.split("val"))
    if len(val_preds) == 1 or len(rows) == 0:
        loss = next(iter(val_preds))
        return loss, f"{loss.replace('_', ' ')} loss"
    target = np.asarray(ds.targets[rows], dtype=np.float64)
    mae = {k: float(np.mean(np.abs(p - target))) for k, p in val_preds.items()}
    loss = min(LOSSES, key=lambda k: (mae[k], LOSSES.index(k)))
    other = next(k for k in LOSSES if k != loss)
    return loss, (
        f"{loss.replace('_', ' ')} loss (validation MAE {mae[loss]:.4g}; "
        f"{other.replace('_', ' ')} {mae[other]:.4g})"
    )


def _long(ds: StagedDataset, rows: np.ndarray, cells: np.ndarray) -> np.ndarray:
    """Samples (row, output cell) -> raw features of the row + the cell's index on each axis."""
    shape = ds.label_shape or ()
    coords = np.unravel_index(cells, shape) if len(shape) > 1 else ()
    feats = np.asarray(ds.features[rows], dtype=np.float64)
    return np.column_stack([feats, *coords]) if coords else feats


def _categorical_mask(ds: StagedDataset, layout: FeatureLayout) -> np.ndarray:
    shape = ds.label_shape or ()
    axes = list(shape) if len(shape) > 1 else []
    mask = [False] * layout.n_features + [size <= CATEGORY_LIMIT for size in axes]
    for i, size in zip(layout.categorical, layout.vocab_sizes, strict=True):
        mask[i] = size <= CATEGORY_LIMIT
    return np.asarray(mask)


def fit_gbt(
    ds: StagedDataset, splits: Sequence[str], cfg: ValidateConfig
) -> tuple[dict[str, np.ndarray], BaselineFit]:
    layout = parse_feature_specs(ds.feature_specs)
    shape = ds.label_shape or ()
    n_cells = int(np.prod(shape)) if shape else 1
    train = np.asarray(ds.split("train"))
    available = len(train) * n_cells
    pick = _sample(available, cfg.baseline_max_rows, np.random.default_rng(SEED))
    rows, cells = train[pick // n_cells], pick % n_cells
    x = _long(ds, rows, cells)
    y = np.asarray(ds.targets[rows], dtype=np.float64).reshape(len(rows), -1)[
        np.arange(len(rows)), cells
    ]
    mask = _categorical_mask(ds, layout)
    fits = {loss: _grow(x, y, mask, loss, cfg) for loss in LOSSES}
    seconds = sum(f[1] for f in fits.values())

    def predict(model: Any, split: str) -> np.ndarray:
        idx = np.asarray(ds.split(split))
        out = np.empty((len(idx), n_cells), dtype=np.float32)
        chunk = max(1, 1_000_000 // n_cells)
        for a in range(0, len(idx), chunk):
            part = idx[a : a + chunk]
            r = np.repeat(part, n_cells)
            c = np.tile(np.arange(n_cells), len(part))
            out[a : a + len(part)] = model.predict(_long(ds, r, c)).reshape(len(part), n_cells)
        return out.reshape(len(idx), *shape)

    loss, detail = _keep(ds, {k: predict(f[0], "val") for k, f in fits.items()})
    model, _, why = fits[loss]
    preds = {split: predict(model, split) for split in splits}
    detail = f"{model.n_iter_} trees, stopped by {why}; {detail}"
    return preds, BaselineFit("gbt", seconds, len(rows), available, detail, False, loss)


def _grow(
    x: np.ndarray, y: np.ndarray, mask: np.ndarray, loss: str, cfg: ValidateConfig
) -> tuple[Any, float, str]:
    """HistGradientBoosting with `loss`, trees added GBT_STEP at a time until early stopping,
    GBT_MAX_ITER trees or the time cap: (model, seconds, what stopped it)."""
    from sklearn.ensemble import HistGradientBoostingRegressor

    model = HistGradientBoostingRegressor(
        loss=loss,
        max_iter=GBT_STEP,
        early_stopping=True,
        validation_fraction=0.1,
        n_iter_no_change=10,
        categorical_features=mask,
        random_state=SEED,
        warm_start=True,
    )
    t0 = time.perf_counter()
    while True:
        model.fit(x, y)
        seconds = time.perf_counter() - t0
        if model.n_iter_ < model.max_iter:
            return model, seconds, "early stopping"
        if model.max_iter >= GBT_MAX_ITER:
            return model, seconds, f"the {GBT_MAX_ITER}-tree limit"
        if seconds >= cfg.baseline_time_s:
            return (
                model,
                seconds,
                f"the time cap (validate.baseline_time_s={cfg.baseline_time_s:g})",
            )
        model.max_iter += GBT_STEP


FITTERS = {"ridge": fit_ridge, "gbt": fit_gbt}


def cache_key(ds: StagedDataset, name: str, cfg: ValidateConfig) -> str:
    import sklearn

    what = {
        "format": FORMAT,
        "data": ds.fingerprint,
        "baseline": name,
        "max_rows": cfg.baseline_max_rows,
        "time_s": cfg.baseline_time_s,
        "sklearn": sklearn.__version__,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


def _read_cache(folder: Path, ds: StagedDataset, splits: Sequence[str]) -> BaselineResult | None:
    """The cached fit, or None when absent or not what it should be (then it is refitted)."""
    try:
        fit = BaselineFit(**{**json.loads((folder / "fit.json").read_text()), "cached": True})
        preds = {}
        for split in splits:
            arr = np.load(folder / f"{split}.npy", allow_pickle=False)
            want = (len(ds.split(split)), *(ds.label_shape or ()))
            if arr.shape != want or not np.isfinite(arr).all():
                return None
            preds[split] = arr
    except (OSError, ValueError, TypeError):
        return None
    return BaselineResult(fit, preds)


def fitted_baselines(
    ds: StagedDataset, cfg: ValidateConfig, splits: Sequence[str], cache: Path
) -> dict[str, BaselineResult]:
    """Each baseline of `cfg.baselines`: its predictions on `splits`, from the cache or fitted
    (and cached) now."""
    out: dict[str, BaselineResult] = {}
    for name in cfg.baselines:
        folder = cache / f"{name}-{cache_key(ds, name, cfg)}"
        hit = _read_cache(folder, ds, splits) if folder.is_dir() else None
        if hit is None:
            preds, fit = FITTERS[name](ds, splits, cfg)
            with atomic_dir(folder) as tmp:
                for split, arr in preds.items():
                    np.save(tmp / f"{split}.npy", arr)
                record = {k: v for k, v in asdict(fit).items() if k != "cached"}
                write_json(tmp / "fit.json", record)
            hit = BaselineResult(fit, preds)
        out[name] = hit
    return out
