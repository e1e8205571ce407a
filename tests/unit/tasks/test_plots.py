"""The PNG plots people look at in MLflow (tasks/tracking/plots.py): the learning curve marks
the epoch early stopping keeps, and the predicted-vs-actual figure's titles overlap no axis
label (issue 32). Measured on the drawn figures, as the saved PNGs show them."""

from __future__ import annotations

import json

import numpy as np

from tasks.tracking import plots


def _boxes(fig, texts):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    return [t.get_window_extent(renderer) for t in texts if t.get_text()]


def test_the_learning_curve_marks_the_best_epoch(tmp_path):
    plt = plots._pyplot()
    losses = [0.9, 0.5, 0.3, 0.21, 0.25, 0.3]
    rows = [
        {"epoch": i, "train_loss": v * 1.1, "val_loss": v, "lr": 0.01} for i, v in enumerate(losses)
    ]
    for best in (3, None):  # distributed-train's train/best_epoch, else the lowest val loss
        fig = plots.loss_curve_figure(plt, rows, best)
        ax = fig.axes[0]
        marks = [line for line in ax.get_lines() if line.get_label().startswith("best: ")]
        assert [m.get_label() for m in marks] == ["best: epoch 4 (val loss 0.21)"]
        assert list(marks[0].get_xdata()) == [4, 4]  # numbered as the console's epoch lines
        assert "best: epoch 4 (val loss 0.21)" in [t.get_text() for t in ax.get_legend().texts]
        plt.close(fig)
    # as the stage draws it, from history.json and metrics.json
    (tmp_path / "history.json").write_text(json.dumps({"epochs": rows}))
    (tmp_path / "metrics.json").write_text(json.dumps({"train/best_epoch": 3.0}))
    assert plots.loss_curve_png(tmp_path / "history.json", tmp_path) == tmp_path / "loss_curves.png"


def test_predicted_vs_actual_titles_overlap_no_axis_label():
    plt = plots._pyplot()
    rng = np.random.default_rng(0)
    target = rng.normal(80, 5, size=(9, 12, 24))
    pred = target + rng.normal(0, 1, size=target.shape)
    picks = np.array([0, 4, 8])
    fig = plots.predicted_vs_actual_figure(
        plt, target, pred, np.arange(9), picks, "test", ["section", "hour"]
    )
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert len(axes) == 6
    titles = _boxes(fig, [ax.title for ax in axes])
    labels = _boxes(fig, [t for ax in axes for t in (ax.xaxis.label, ax.yaxis.label)])
    ticks = _boxes(fig, [t for ax in axes for t in ax.get_xticklabels()])
    clashes = [(a, b) for a in titles for b in labels + ticks if a.overlaps(b)]
    assert not clashes, clashes
    plt.close(fig)
