"""The end-of-epoch validation pass counts as progress batch by batch: on 10^6 rows under a
loaded machine, a pass longer than `runtime.hang_timeout_s` was declared a hang ("rank 0 hung
in phase validate step 0 (no progress for 61 s)") while every forward was completing."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from enn_core.runtime.heartbeat import Heartbeat
from enn_core.train.evaluate import validate

BATCHES, PAUSE_S = 6, 0.05


class Slow(nn.Module):
    """A forward that takes PAUSE_S, as a large batch on a busy machine does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(PAUSE_S)
        return x[:, :2]


def test_each_validation_batch_is_progress(tmp_path):
    rows = 8 * BATCHES
    features = np.random.default_rng(0).normal(size=(rows, 3)).astype(np.float32)
    labels = features[:, :2].copy()
    beat = Heartbeat(tmp_path, rank=0, interval=60.0)
    rt = SimpleNamespace(
        model=Slow(),
        loss=nn.L1Loss(),
        heartbeat=beat,
        env=SimpleNamespace(rank=0, world_size=1, device="cpu", distributed=False),
        autocast=contextlib.nullcontext,
        core=SimpleNamespace(normalize=lambda y: y, denormalize=lambda p: p),
    )
    data = SimpleNamespace(val_rows=np.arange(rows), features=features, labels=labels)
    st = SimpleNamespace(rt=rt, data=data, eval_batch=8)
    t0 = time.time()
    got = validate(st, epoch=1)  # type: ignore[arg-type]
    assert got is not None and got["rows"] == rows and got["mae"] < 1e-6
    # the last batch's progress is recorded, not only the phase's start
    assert beat.where() == ("validate", 1)
    assert beat._state["progress_time"] >= t0 + (BATCHES - 1) * PAUSE_S
