"""The labels' majority value per output, read in chunks (enn_core.data.label_mode): exact
wherever one value holds more than half of an output, whatever the chunk size and the rows
picked, on a memmap as on an array."""

from __future__ import annotations

import numpy as np
import pytest

from enn_core.data.label_mode import label_mode, output_name
from enn_core.errors import DataError


@pytest.mark.parametrize("seed", range(6))
def test_the_majority_of_each_output_is_exact_in_any_chunks(tmp_path, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(20, 400))
    y = rng.integers(0, 5, (n, 2, 3)).astype(np.float32)
    y[rng.random(y.shape) < rng.uniform(0.2, 0.9, (1, 2, 3))] = 0.0  # some outputs mostly 0
    np.save(tmp_path / "labels.npy", y)
    labels = np.load(tmp_path / "labels.npy", mmap_mode="r")
    rows = np.sort(rng.choice(n, int(rng.integers(1, n + 1)), replace=False))
    mode = label_mode(labels, rows, chunk_rows=int(rng.integers(1, 17)))
    flat = y[rows].reshape(len(rows), -1)
    for j in range(flat.shape[1]):
        values, counts = np.unique(flat[:, j], return_counts=True)
        top = counts.max() / len(rows)
        if top > 0.5:
            assert mode.values[j] == values[counts.argmax()] and mode.shares[j] == top
        else:
            assert mode.shares[j] <= 0.5
    assert mode.n_mostly == int(
        sum(np.unique(c, return_counts=True)[1].max() > len(rows) / 2 for c in flat.T)
    )


def test_a_label_two_thirds_zeros_is_mostly_one_value_and_named():
    y = np.array([[0.0], [0.0], [3.5], [0.0], [1.0], [0.0]], dtype=np.float32)
    mode = label_mode(y, chunk_rows=2)
    assert mode.mostly_one_value and mode.top_value == 0.0 and mode.top_share == 4 / 6
    assert output_name(mode.top, (1,), ("axis0",), {"axis0": ["count"]}) == "count"
    assert output_name(5, (2, 3), ("section", "hour")) == "section1|hour2"
    assert not label_mode(np.arange(6, dtype=np.float32).reshape(6, 1)).mostly_one_value
    with pytest.raises(DataError, match="no training rows"):
        label_mode(y, np.arange(0))
