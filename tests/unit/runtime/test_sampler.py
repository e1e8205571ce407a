"""The sampler: every row once, equal steps, zero-weight padding, world-size-free state."""

from __future__ import annotations

import numpy as np
import pytest

from enn_core.errors import ConfigError
from enn_core.runtime.sampler import GlobalBlockSampler, eval_slices, make_plan, micro_batches


def test_every_row_once_per_epoch_equal_steps_padding_weighs_zero():
    """The last batch (5 of 8 rows) is padded only to a multiple of the world size: one rank
    computes 5 rows, not 8; two ranks 3 each; four ranks 2 each (the same on every rank)."""
    rows = np.arange(100, 137)  # 37 training rows (staged indices)
    s = GlobalBlockSampler(rows, 8, seed=3)
    assert s.steps_per_epoch == 5
    for world in (1, 2, 4):
        seen, weights = [], []
        for step in range(s.steps_per_epoch):
            for rank in range(world):
                r, w = s.step_rows(0, step, rank, world)
                last = -(-5 // world) if step == 4 else 8 // world
                assert len(r) == len(w) == last  # same shape on every rank
                seen.append(r[w > 0])
                weights.append(w)
        got = np.concatenate(seen)
        assert sorted(got.tolist()) == rows.tolist()  # each real row exactly once
        assert np.concatenate(weights).sum() == 37 and s.real_rows(0, 4) == 5
        assert len(np.concatenate(weights)) == 32 + -(-5 // world) * world


def test_global_batches_do_not_depend_on_world_size_and_epochs_reshuffle():
    s = GlobalBlockSampler(np.arange(40), 8, seed=1)
    one = s.step_rows(2, 3, 0, 1)[0]
    two = np.concatenate([s.step_rows(2, 3, r, 2)[0] for r in range(2)])
    assert one.tolist() == two.tolist()  # resume at another world size reads the same batch
    assert s.epoch_order(0).tolist() != s.epoch_order(1).tolist()
    again = GlobalBlockSampler(np.arange(40), 8, seed=1)
    assert again.epoch_order(1).tolist() == s.epoch_order(1).tolist()


def test_shuffle_blocks_are_contiguous_runs():
    s = GlobalBlockSampler(np.arange(64), 16, seed=0, shuffle_block=8)
    order = s.epoch_order(0).reshape(-1, 8)
    assert (np.diff(order, axis=1) == 1).all() and sorted(order[:, 0] % 8) == [0] * 8


def test_micro_batches_read_in_order_and_plan_checks():
    feats = np.arange(20, dtype=np.float32).reshape(10, 2)
    labels = np.arange(10, dtype=np.float32).reshape(10, 1)
    mbs = micro_batches(
        feats, labels, np.array([7, 2, 5, 2]), np.array([1, 1, 1, 0], np.float32), 2
    )
    assert [b.labels[:, 0].tolist() for b in mbs] == [[7, 2], [5, 2]]
    assert make_plan(8, 0, 2).accumulation == 1 and make_plan(8, 2, 2).accumulation == 2
    with pytest.raises(ConfigError, match="multiple of 3"):
        make_plan(8, 0, 3)
    with pytest.raises(ConfigError, match="divisor of 4"):
        make_plan(8, 3, 2)


def test_eval_slices_same_count_on_every_rank():
    counts = {r: eval_slices(5, 2, r, 4) for r in range(4)}
    assert len({len(v) for v in counts.values()}) == 1
    assert sum(n for v in counts.values() for _, _, n in v) == 5
