"""Tiny manifests and feature matrices in the staged format of docs/design.md."""

from __future__ import annotations

import numpy as np


def make_manifest(sections: int = 5, hours: int = 4, label_shape: list[int] | None = None) -> dict:
    shape = label_shape or [sections, hours]
    return {
        "format_version": 1,
        "mode": "training",
        "n_rows": 24,
        "feature_specs": [
            {
                "name": "month",
                "kind": "categorical",
                "vocab": [f"{m:02d}" for m in range(1, 13)],
                "cyclic_period": 12,
            },
            {"name": "daytype", "kind": "categorical", "vocab": list("0123456")},
            {"name": "direction", "kind": "categorical", "vocab": ["up", "down"]},
            {"name": "temp", "kind": "continuous", "mean": 12.0, "std": 4.0},
        ],
        "label_shape": shape,
        "label_axes": ["section", "hour"][: len(shape)],
        "label_axis_values": {"section": [f"s{i}" for i in range(shape[0])]},
        "label_stats": {"mean": 80.0, "std": 15.0, "cell_mean_file": None},
        "row_keys": ["month", "daytype", "direction"],
        "content_hash": "abc123",
        "naive_keys": ["daytype", "direction"],
    }


def make_features(n: int = 6, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack(
        [
            rng.integers(0, 12, n),
            rng.integers(0, 7, n),
            rng.integers(0, 2, n),
            rng.normal(12, 4, n),
        ],
        axis=1,
    ).astype(np.float32)
