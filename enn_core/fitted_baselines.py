"""What a practitioner tries first, scored by validate beside the model on the same rows:

- `ridge`: RidgeCV (alpha by generalized cross-validation) on the encoded features (one-hot
  categoricals, sin/cos of cyclic values, z-scored numbers: the encoding the model starts
  from, with one-hot in place of learned embeddings), one linear model per output cell;
- `gbt`: scikit-learn's HistGradientBoostingRegressor in long format: one sample per row and
  output cell, the raw features plus the cell's position on each label axis, categorical
  columns as categories (early stopping on a held-out tenth of the samples).

Both fit on the training split only, for the metric validate reports (MAE): with the
absolute-error loss (`ridge`: the same encoding and penalty, iteratively reweighted towards
least absolute deviations; `gbt`: `loss="absolute_error"`), once. `validate.baseline_losses`
may add squared error: each loss is then fitted and the squared-error fit is kept only when
its MAE on the validation rows is lower (chosen on the validation rows, so the test rows stay
unseen); `BaselineFit.loss` and the detail say which ran and both validation MAEs.

They must not slow every run: each loss's fit is cached per data fingerprint (features,
labels and splits), baseline, loss and settings under `<work>/cache/baselines/` (asking for
both losses reuses the absolute-error fit already there), and capped: more than
`validate.baseline_max_rows` training samples are subsampled (seeded), and
`validate.baseline_time_s` bounds a baseline's whole time (every loss's fit and its
predictions): gbt adds trees in steps sized by the pace it measures, stopping when the next
step and the predictions would pass the cap; ridge stops reweighting. When even the least a
fit can do passes the cap by more than a tenth, the detail says so and why. The fits run on
one thread: OpenMP's waiting threads made a 25-tree step 10-30x slower on a busy machine.
Memory does not grow with the rows: the fits hold their subsample (ridge at most
ENCODED_CELLS encoded numbers; its absolute-error fit outputs x features^2 more, which
L1_CELLS bounds, never a row's outer product), and the predictions are made a chunk of rows
at a time into the cache's files, read back mapped (docs/design.md, issue 51).
While fitting, validate says which baseline it fits and a bar (on a terminal) counts the
trees or reweighting steps. The champion rule does not look at them (it keeps its
naive-predictor gate); validate reports them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from enn_core.atomic import atomic_dir, write_json
from enn_core.baselines import L1_ITERATIONS, Tick, l1_ridge
from enn_core.config.stages import ValidateConfig
from enn_core.data.dataset import StagedDataset
from enn_core.errors import DataError
from enn_core.model.encoding import FeatureLayout, parse_feature_specs

FORMAT = 3  # bump when a baseline's definition changes: the cache keys change with it
LOSSES = ("absolute_error", "squared_error")  # the metric's loss first: kept on a tie
L1_CELLS = 50_000_000  # ridge's L1 variant: at most outputs x features^2 normal-equation numbers
SEED = 0
GBT_FIRST = 5  # trees of the first step: it measures the pace
GBT_STEP = 25  # near the cap, a step of fewer trees than twice this is the last
GBT_MAX_ITER = 300
PROBE_SAMPLES = 10_000  # samples predicted once to measure the prediction's pace
SAFETY = 0.9  # share of the time left that gbt's trees are planned to fill
OVER = 1.1  # a fit's whole time may pass the cap by this factor before the detail says why
ENCODED_CELLS = 20_000_000  # ridge: at most this many encoded numbers in memory (float32)
CATEGORY_LIMIT = 254  # HistGradientBoosting's categories must stay below max_bins (255)
THREADS = 1  # see the module docstring


@dataclass(frozen=True)
class BaselineFit:
    """How one baseline was fitted (the metrics files and the Prefect table show it)."""

    name: str
    fit_s: float  # seconds of its fits and predictions (as they were run, cached or not)
    samples: int  # training samples used (gbt: rows x output cells)
    available: int  # training samples there were
    detail: str  # alpha (ridge); trees and why it stopped (gbt); the loss(es) and their MAEs
    cached: bool  # read from the cache in this run
    loss: str = ""  # the loss of the fit kept: absolute_error or squared_error
    floor_s: float = 0.0  # the least this fit could take (why it passed the cap, if it did)

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


def _words(loss: str) -> str:
    return loss.replace("_", " ")


def fit_ridge(
    ds: StagedDataset,
    splits: Sequence[str],
    cfg: ValidateConfig,
    loss: str,
    deadline: float,
    tick: Tick,
    out: Path,
    chunk_rows: int | None = None,
) -> tuple[dict[str, np.ndarray], BaselineFit]:
    from sklearn.linear_model import RidgeCV

    t0 = time.perf_counter()
    layout = parse_feature_specs(ds.feature_specs)
    train = np.asarray(ds.split("train"))
    width = encode(ds.features[:1], layout).shape[1]
    cap = max(100, min(cfg.baseline_max_rows, ENCODED_CELLS // max(width, 1)))
    rows = train[_sample(len(train), cap, np.random.default_rng(SEED))]
    y = np.asarray(ds.targets[rows], dtype=np.float64)
    flat = y.reshape(len(y), -1)
    x = encode(ds.features[rows], layout).astype(np.float64)
    model = RidgeCV(alphas=np.logspace(-3, 3, 13)).fit(x, flat)
    alpha = float(model.alpha_)
    # [1 + features, outputs]: the intercept row, then the weights (y is always 2-D here)
    coef = np.vstack([np.atleast_1d(model.intercept_)[None], np.atleast_2d(model.coef_).T])
    floor_s = 2 * (time.perf_counter() - t0)  # the least-squares fit, and predictions as long
    note = ""
    if loss == "absolute_error":
        if flat.shape[1] * (width + 1) ** 2 <= L1_CELLS:
            coef, steps = l1_ridge(x, flat, alpha, coef, deadline - floor_s / 2, tick)
            if steps < L1_ITERATIONS:
                note = (
                    f", stopped after {steps} of {L1_ITERATIONS} reweighting steps by the time "
                    f"cap (validate.baseline_time_s={cfg.baseline_time_s:g})"
                )
        else:
            loss = "squared_error"
            note = "; its least-absolute-deviation fit skipped (too many outputs x features)"
    preds = {}
    step = max(1, ENCODED_CELLS // 4 // max(width, 1))  # the rows encoded at once
    step = min(step, chunk_rows or step)  # data.chunk_rows
    for split in splits:
        idx = np.asarray(ds.split(split))
        preds[split] = arr = _written(out, split, (len(idx), *y.shape[1:]))
        for a in range(0, len(idx), step):
            xs = encode(ds.features[idx[a : a + step]], layout).astype(np.float64)
            arr[a : a + len(xs)] = (coef[0] + xs @ coef[1:]).reshape(len(xs), *y.shape[1:])
    seconds = time.perf_counter() - t0
    detail = f"alpha {alpha:.3g}, {width} encoded features, {_words(loss)} loss{note}"
    fit = BaselineFit("ridge", seconds, len(rows), len(train), detail, False, loss, floor_s)
    return preds, fit


def _long(ds: StagedDataset, rows: np.ndarray, cells: np.ndarray) -> np.ndarray:
    """Samples (row, output cell) -> raw features of the row + the cell's index on each axis."""
    shape = ds.label_shape or ()
    coords = np.unravel_index(cells, shape) if len(shape) > 1 else ()
    uniq, inverse = np.unique(rows, return_inverse=True)  # a row repeats once per cell
    feats = np.asarray(ds.features[uniq], dtype=np.float64)[inverse]
    return np.column_stack([feats, *coords]) if coords else feats


def _categorical_mask(ds: StagedDataset, layout: FeatureLayout) -> np.ndarray:
    shape = ds.label_shape or ()
    axes = list(shape) if len(shape) > 1 else []
    mask = [False] * layout.n_features + [size <= CATEGORY_LIMIT for size in axes]
    for i, size in zip(layout.categorical, layout.vocab_sizes, strict=True):
        mask[i] = size <= CATEGORY_LIMIT
    return np.asarray(mask)


def fit_gbt(
    ds: StagedDataset,
    splits: Sequence[str],
    cfg: ValidateConfig,
    loss: str,
    deadline: float,
    tick: Tick,
    out_dir: Path,
    chunk_rows: int | None = None,
) -> tuple[dict[str, np.ndarray], BaselineFit]:
    t0 = time.perf_counter()
    layout = parse_feature_specs(ds.feature_specs)
    shape = ds.label_shape or ()
    n_cells = int(np.prod(shape)) if shape else 1
    train = np.asarray(ds.split("train"))
    available = len(train) * n_cells
    pick = _sample(available, cfg.baseline_max_rows, np.random.default_rng(SEED))
    rows, cells = train[pick // n_cells], pick % n_cells
    x = _long(ds, rows, cells)
    # each sample's own cell, read from the training rows once (a row per sample copied
    # every cell: 200,000 x 936 numbers on a 39 x 24 grid)
    uniq, inverse = np.unique(rows, return_inverse=True)
    y = np.asarray(ds.targets[uniq], dtype=np.float64).reshape(len(uniq), -1)[inverse, cells]
    predicted = sum(len(ds.split(s)) for s in splits) * n_cells
    mask = _categorical_mask(ds, layout)
    model, why, first_s, grow_s = _grow(x, y, mask, loss, deadline, predicted, tick)
    if why == "time":
        why = f"the time cap (validate.baseline_time_s={cfg.baseline_time_s:g})"
    preds = {}
    for split in splits:
        idx = np.asarray(ds.split(split))
        preds[split] = written = _written(out_dir, split, (len(idx), *shape))
        out = written.reshape(len(idx), n_cells)
        chunk = max(1, 1_000_000 // n_cells)
        chunk = min(chunk, chunk_rows or chunk)  # data.chunk_rows
        for a in range(0, len(idx), chunk):
            part = idx[a : a + chunk]
            r = np.repeat(part, n_cells)
            c = np.tile(np.arange(n_cells), len(part))
            out[a : a + len(part)] = model.predict(_long(ds, r, c)).reshape(len(part), n_cells)
    end = time.perf_counter()
    floor_s = (end - t0) - (grow_s - first_s)  # all but the steps after the first
    detail = f"{model.n_iter_} trees, stopped by {why}; {_words(loss)} loss"
    fit = BaselineFit("gbt", end - t0, len(rows), available, detail, False, loss, floor_s)
    return preds, fit


def _grow(
    x: np.ndarray,
    y: np.ndarray,
    mask: np.ndarray,
    loss: str,
    deadline: float,
    predicted: int,
    tick: Tick,
) -> tuple[Any, str, float, float]:
    """HistGradientBoosting with `loss`: GBT_FIRST trees, which measure the pace, then the
    trees that fit before `deadline` (predicting `predicted` samples with every tree included)
    in few warm-started steps (each step re-predicts the trees so far on the training
    samples): all of them when the time left is twice what they need, else half of what fits,
    measured again after, and the last step what fits then. Stops at early stopping,
    GBT_MAX_ITER trees, or when not one more tree fits ("time").
    Returns (model, what stopped it, the first step's seconds, all steps' seconds)."""
    from sklearn.ensemble import HistGradientBoostingRegressor

    model = HistGradientBoostingRegressor(
        loss=loss,
        max_iter=GBT_FIRST,
        early_stopping=True,
        validation_fraction=0.1,
        n_iter_no_change=10,
        categorical_features=mask,
        random_state=SEED,
        warm_start=True,
    )
    first_s, grow_s, trees, predict_per_tree = 0.0, 0.0, 0, 0.0
    while True:
        s0 = time.perf_counter()
        model.fit(x, y)
        took = time.perf_counter() - s0
        grow_s += took
        first_s = first_s or took
        added, trees = model.n_iter_ - trees, model.n_iter_
        tick(trees, GBT_MAX_ITER)
        if model.n_iter_ < model.max_iter:
            return model, "early stopping", first_s, grow_s
        if model.max_iter >= GBT_MAX_ITER:
            return model, f"the {GBT_MAX_ITER}-tree limit", first_s, grow_s
        if not predict_per_tree:  # the pace of predicting: a probe of the training samples
            probe = x[: min(len(x), PROBE_SAMPLES)]
            p0 = time.perf_counter()
            model.predict(probe)
            predict_per_tree = (time.perf_counter() - p0) / (trees * len(probe)) * predicted
        per_tree = took / max(added, 1) + predict_per_tree
        left = deadline - time.perf_counter() - predict_per_tree * trees
        fits, wanted = int(SAFETY * left / per_tree), GBT_MAX_ITER - trees
        if fits < 1:
            return model, "time", first_s, grow_s
        n = wanted if fits >= 2 * wanted else fits // 2 if fits >= 2 * GBT_STEP else fits
        model.max_iter += n


FITTERS = {"ridge": fit_ridge, "gbt": fit_gbt}


def cache_key(ds: StagedDataset, name: str, loss: str, cfg: ValidateConfig) -> str:
    """The cache entry's name: the data, the baseline, its settings and scikit-learn's version
    (read from its metadata: a cache hit, such as export's champion rule, never imports it,
    1.1 s)."""
    from importlib.metadata import version

    what = {
        "format": FORMAT,
        "data": ds.fingerprint,
        "baseline": name,
        "loss": loss,
        "max_rows": cfg.baseline_max_rows,
        "time_s": cfg.baseline_time_s,
        "sklearn": version("scikit-learn"),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


def _written(folder: Path, split: str, shape: tuple[int, ...]) -> np.ndarray:
    """`folder/<split>.npy`, float32 of `shape`, mapped for writing: a split's predictions go
    to the cache as they are made, never all in memory."""
    return np.lib.format.open_memmap(folder / f"{split}.npy", "w+", np.float32, shape)


def _read_cache(folder: Path, ds: StagedDataset, splits: Sequence[str]) -> BaselineResult | None:
    """The cached fit, or None when absent or not what it should be (then it is refitted)."""
    try:
        fit = BaselineFit(**{**json.loads((folder / "fit.json").read_text()), "cached": True})
    except (OSError, ValueError, TypeError):
        return None
    preds = _cached_predictions(folder, ds, splits)
    return None if preds is None else BaselineResult(fit, preds)


def _cached_predictions(
    folder: Path, ds: StagedDataset, splits: Sequence[str]
) -> dict[str, np.ndarray] | None:
    """Each split's predictions in `folder`, mapped read-only (a split of 10^7 rows is read as
    it is used), or None when one is absent, damaged, of another shape or not finite."""
    preds = {}
    try:
        for split in splits:
            arr = np.load(folder / f"{split}.npy", mmap_mode="r", allow_pickle=False)
            want = (len(ds.split(split)), *(ds.label_shape or ()))
            if arr.shape != want or arr.dtype != np.float32:
                return None
            step = max(1, ENCODED_CELLS // max(int(np.prod(want[1:])), 1))
            if not all(np.isfinite(arr[a : a + step]).all() for a in range(0, len(arr), step)):
                return None
            preds[split] = arr
    except (OSError, ValueError, TypeError):
        return None
    return preds


def fitted_baselines(
    ds: StagedDataset,
    cfg: ValidateConfig,
    splits: Sequence[str],
    cache: Path,
    say: Callable[[str], None] | None = None,
    bar_enabled: bool = False,
    say_after_s: float = 0.0,
    chunk_rows: int | None = None,
) -> dict[str, BaselineResult]:
    """Each baseline of `cfg.baselines`: its predictions on `splits`, each loss of
    `cfg.baseline_losses` from the cache or fitted (and cached) now, the better kept. `say`
    gets a line for each fit still running `say_after_s` seconds after it began (0: before it
    begins; a fit of a fraction of a second needs no line); `bar_enabled`: a bar on a terminal
    while it runs."""
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]  # no stubs

    from enn_core.progress import bar

    out: dict[str, BaselineResult] = {}
    for name in cfg.baselines:
        deadline = time.perf_counter() + cfg.baseline_time_s
        per_loss: dict[str, BaselineResult] = {}
        losses = list(cfg.baseline_losses)
        for i, loss in enumerate(losses):
            folder = cache / f"{name}-{loss}-{cache_key(ds, name, loss, cfg)}"
            hit = _read_cache(folder, ds, splits) if folder.is_dir() else None
            if hit is None:  # scikit-learn's import (a second, cold) is not on the fit's clock
                began = time.perf_counter()
                import sklearn  # noqa: F401

                deadline += time.perf_counter() - began
                share = (deadline - time.perf_counter()) / (len(losses) - i)
                line = (
                    f"{name} baseline: fitting with the {_words(loss)} loss (at most "
                    f"{max(share, 0):.0f} s: validate.baseline_time_s={cfg.baseline_time_s:g})"
                )
                unit = "tree" if name == "gbt" else "step"
                with (
                    atomic_dir(folder) as tmp,
                    _said(say, line, say_after_s),
                    bar(None, f"{name} baseline", bar_enabled, unit, delay=0.0) as pbar,
                    _refreshing(pbar),
                ):

                    def tick(done: int, total: int, pbar: Any = pbar) -> None:
                        pbar.total = total
                        pbar.update(done - pbar.n)

                    with threadpool_limits(THREADS):
                        preds, fit = FITTERS[name](
                            ds,
                            splits,
                            cfg,
                            loss,
                            time.perf_counter() + share,
                            tick,
                            tmp,
                            chunk_rows,
                        )
                    for arr in preds.values():
                        arr.flush()  # type: ignore[attr-defined]  # a memmap
                    record = {k: v for k, v in asdict(fit).items() if k != "cached"}
                    write_json(tmp / "fit.json", record)
                del preds  # the files were written in tmp; they are read where they now lie
                written = _cached_predictions(folder, ds, splits)
                if written is None:
                    raise DataError(
                        f"{folder}: the {name} baseline's predictions are not finite; "
                        "re-run validate (report it if it happens again)"
                    )
                hit = BaselineResult(fit, written)
            per_loss[loss] = hit
        out[name] = _choose(ds, per_loss, cfg)
    return out


@contextlib.contextmanager
def _said(say: Callable[[str], None] | None, line: str, after_s: float) -> Iterator[None]:
    """`say(line)` now (`after_s` 0), or once `after_s` seconds pass while the body runs."""
    if say is None:
        yield
        return
    if after_s <= 0:
        say(line)
        yield
        return
    timer = threading.Timer(after_s, say, (line,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@contextlib.contextmanager
def _refreshing(pbar: Any, interval: float = 1.0) -> Iterator[None]:
    """Redraw `pbar` every `interval` seconds while the body runs: its clock moves during a
    long step (scikit-learn's fit releases the GIL)."""
    if pbar.disable:
        yield
        return
    stop = threading.Event()

    def redraw() -> None:
        while not stop.wait(interval):
            pbar.refresh()

    t = threading.Thread(target=redraw, name="enn-baseline-bar", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=interval + 5)


def _mae(pred: np.ndarray, ds: StagedDataset, rows: np.ndarray) -> float:
    """MAE of `pred` (in the order of `rows`) against the targets at `rows`, in chunks."""
    if not len(rows):
        return 0.0
    cells = int(np.prod(pred.shape[1:]))
    step, total = max(1, ENCODED_CELLS // max(cells, 1)), 0.0
    for a in range(0, len(rows), step):
        target = np.asarray(ds.targets[rows[a : a + step]], dtype=np.float64)
        total += float(np.abs(np.asarray(pred[a : a + step], np.float64) - target).sum())
    return total / (len(rows) * cells)


def _choose(
    ds: StagedDataset, per_loss: Mapping[str, BaselineResult], cfg: ValidateConfig
) -> BaselineResult:
    """The loss whose fit has the lower MAE on the validation rows (the first of LOSSES on a
    tie, or without validation predictions), its detail naming both MAEs; the time of all
    fits, and why it passed the cap when it did."""
    fits = [r.fit for r in per_loss.values()]
    kept = next(iter(per_loss.values()))
    detail = kept.fit.detail
    if len(per_loss) > 1 and all("val" in r.predictions for r in per_loss.values()):
        rows = np.asarray(ds.split("val"))
        mae = {k: _mae(r.predictions["val"], ds, rows) for k, r in per_loss.items()}
        order = sorted(per_loss, key=lambda k: (mae[k], LOSSES.index(k)))
        kept = per_loss[order[0]]
        others = "; ".join(f"{_words(k)} {mae[k]:.4g}" for k in order[1:])
        detail = f"{kept.fit.detail} (validation MAE {mae[order[0]]:.4g}; {others})"
    seconds = sum(f.fit_s for f in fits)
    floor_s = sum(f.floor_s for f in fits)
    if seconds > OVER * cfg.baseline_time_s:
        least = "s" if len(fits) > 1 else ""
        why = (
            f"the least its fit{least} could do (the first step and the predictions) took "
            f"{floor_s:.1f} s"
            if floor_s > cfg.baseline_time_s
            else f"its steps ran slower than the pace measured at the first (the least its "
            f"fit{least} could do: {floor_s:.1f} s; a busy machine?)"
        )
        detail += f"; {seconds:.1f} s, over validate.baseline_time_s={cfg.baseline_time_s:g}: {why}"
    fit = BaselineFit(
        kept.fit.name,
        seconds,
        kept.fit.samples,
        kept.fit.available,
        detail,
        all(f.cached for f in fits),
        kept.fit.loss,
        floor_s,
    )
    return BaselineResult(fit, kept.predictions)
