"""PNG plots for MLflow (`dvc plots show` renders blank offline: its HTML loads a chart library
from a CDN, so the pictures people look at live in MLflow).

- after distributed-train: loss curves (train and validation loss, learning rate) per epoch;
- after predict: predicted vs actual heatmaps for a few groups (grid labels) and a residual
  histogram, from `outputs/predict/predictions.npy` and the staged labels of the same rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from enn_core.paths import Layout
from enn_core.stages import DISTRIBUTED_TRAIN, PREDICT, STAGE_DATA


def _pyplot() -> ModuleType:
    """matplotlib's pyplot on the Agg backend (no display), imported when a plot is drawn:
    importing this module has no side effects (pyplot builds a font cache on first import)."""
    import matplotlib

    matplotlib.use("Agg")  # must precede pyplot
    import matplotlib.pyplot as plt

    return plt


def loss_curves(layout: Layout, out_dir: Path) -> list[Path]:
    """Train and validation loss and the learning rate per epoch (distributed-train)."""
    path = loss_curve_png(DISTRIBUTED_TRAIN.output_dir(layout) / "history.json", out_dir)
    return [path] if path else []


def loss_curve_png(history_path: Path, out_dir: Path) -> Path | None:
    plt = _pyplot()
    if not history_path.exists():
        return None
    out_png = out_dir / "loss_curves.png"
    history = json.loads(history_path.read_text())
    rows = history if isinstance(history, list) else history.get("epochs", [])
    if not rows:
        return None
    metrics = history_path.parent / "metrics.json"
    best = json.loads(metrics.read_text()).get("train/best_epoch") if metrics.exists() else None
    fig = loss_curve_figure(plt, rows, best)
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
    return out_png


def loss_curve_figure(plt: ModuleType, rows: list[dict], best: float | None = None) -> Any:
    """Train and validation loss and the learning rate per epoch, numbered as the console's
    epoch lines (from 1), the best epoch marked: the one early stopping keeps
    (`train/best_epoch`, else the lowest validation loss)."""
    epochs = [int(r.get("epoch", i)) + 1 for i, r in enumerate(rows)]
    fig, (ax, ax_lr) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    for key in sorted({k for r in rows for k in r if "loss" in k}):
        ax.plot(epochs, [r.get(key, np.nan) for r in rows], marker="o", label=key)
    val = [r.get("val_loss") for r in rows]
    if best is None and any(isinstance(v, (int, float)) for v in val):
        best = float(np.nanargmin([np.nan if v is None else v for v in val]))
    if best is not None:
        at = int(best) + 1
        where = next((i for i, e in enumerate(epochs) if e == at), None)
        value = val[where] if where is not None else None
        text = f"best: epoch {at}" + (f" (val loss {value:.4g})" if value is not None else "")
        ax.axvline(at, color="black", linestyle="--", linewidth=1, label=text)
        ax_lr.axvline(at, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss (normalized units)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("loss curves")
    lr_keys = [k for k in ("lr", "learning_rate") if any(k in r for r in rows)]
    for key in lr_keys:
        ax_lr.plot(epochs, [r.get(key, np.nan) for r in rows], marker=".")
    ax_lr.set_title("learning rate (end of epoch)")
    ax_lr.set_xlabel("epoch")
    return fig


PLOT_ROWS = 100_000  # the rows a prediction plot reads at most: a seeded sample beyond


def plotted_rows(rows: np.ndarray, most: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(positions in `rows`, those rows): every one, or a seeded sample of `most` in order, so
    that a split of 10^7 rows is not read whole (0.4 GB of labels, predictions and residuals)
    for a histogram of 60 bins."""
    most = PLOT_ROWS if most is None else most
    at = np.arange(len(rows))
    if len(rows) > most:
        at = np.sort(np.random.default_rng(0).choice(len(rows), size=most, replace=False))
    return at, rows[at]


def prediction_plots(layout: Layout, out_dir: Path, n_groups: int = 3) -> list[Path]:
    plt = _pyplot()
    from enn_core.data.dataset import StagedDataset

    pred_path = PREDICT.output_dir(layout) / "predictions.npy"
    manifest_path = PREDICT.output_dir(layout) / "manifest.json"
    if not pred_path.exists():
        return []
    pred = np.load(pred_path, mmap_mode="r")
    ds = StagedDataset(STAGE_DATA.output_dir(layout))
    if ds.labels is None:
        return []
    meta = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    split = meta.get("split") or "test"
    rows = (
        np.asarray(ds.split(split)) if split in ("train", "val", "test") else np.arange(len(pred))
    )
    if len(rows) != len(pred):
        return []
    at, rows = plotted_rows(rows)
    target = np.asarray(ds.labels[rows])
    shown = f"{split}, {len(at):,} of {len(pred):,} rows" if len(at) < len(pred) else split
    pred = np.asarray(pred[at])
    out: list[Path] = []
    residual = (pred - target).ravel()
    fig, ax = plt.subplots(figsize=(5, 3.5), layout="constrained")
    ax.hist(residual, bins=60)
    ax.set_title(f"residuals on {shown} (MAE {np.abs(residual).mean():.3g})")
    ax.set_xlabel("prediction - target (real units)")
    out.append(out_dir / "residual_histogram.png")
    fig.savefig(out[-1], dpi=80)
    plt.close(fig)
    if pred.ndim == 3:
        picks = np.linspace(0, len(pred) - 1, num=min(n_groups, len(pred))).astype(int)
        axes_names = list(ds.manifest.label_axes) or ["axis 0", "axis 1"]
        fig = predicted_vs_actual_figure(plt, target, pred, rows, picks, split, axes_names)
        out.append(out_dir / "predicted_vs_actual.png")
        fig.savefig(out[-1], dpi=80)
        plt.close(fig)
    return out


def predicted_vs_actual_figure(
    plt: ModuleType,
    target: np.ndarray,
    pred: np.ndarray,
    rows: np.ndarray,
    picks: np.ndarray,
    split: str,
    axes_names: list[str],
) -> Any:
    """Actual and predicted label grids of a few rows side by side, one colour scale."""
    # constrained layout keeps each title clear of the axis labels of the row above and of the
    # shared colour bar (tight_layout does not place a colour bar over several axes)
    fig, axes = plt.subplots(
        len(picks), 2, figsize=(8, 2.8 * len(picks)), squeeze=False, layout="constrained"
    )
    lo, hi = float(np.min(target[picks])), float(np.max(target[picks]))
    for r, i in enumerate(picks):
        for c, (name, grid) in enumerate((("actual", target[i]), ("predicted", pred[i]))):
            im = axes[r][c].imshow(grid, aspect="auto", vmin=lo, vmax=hi, cmap="viridis")
            axes[r][c].set_title(f"{split} row {int(rows[i])}: {name}")
            axes[r][c].set_ylabel(axes_names[0])
            axes[r][c].set_xlabel(axes_names[1])
    fig.colorbar(im, ax=axes, shrink=0.6)
    return fig


# The plots a stage spec may name (`StageSpec.plots`): each takes the layout and a folder.
PLOTS = {"loss_curves": loss_curves, "predictions": prediction_plots}
