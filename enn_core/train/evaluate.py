"""Validation at the end of every epoch: loss in normalized units (early stopping) and MAE /
RMSE in real units (the model's own denormalization).

Every rank runs every forward (FIELD_NOTES: rank-0-only evaluation under FSDP2 hangs until
the timeout): the validation rows are split in contiguous per-rank ranges and ranks with
fewer rows run weight-0 forwards. Sums travel in one all-reduce, so every rank gets the same
numbers and makes the same early-stopping decision.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.distributed.fsdp import FSDPModule

from enn_core.runtime.dist import all_reduce_sum
from enn_core.runtime.sampler import eval_slices, read_rows
from enn_core.train.objective import weighted_loss_sum
from enn_core.train.state import TrainState


def validate(st: TrainState, epoch: int) -> dict[str, float] | None:
    """{loss, mae, rmse, rows} over the validation split, or None when it is empty."""
    rt, data = st.rt, st.data
    n = len(data.val_rows)
    if n == 0:
        return None
    if rt.heartbeat is not None:
        rt.heartbeat.phase("validate", epoch)
    rt.model.eval()
    rt.loss.eval()
    sums = torch.zeros(5, dtype=torch.float64)  # loss sum, rows, |err| sum, err^2 sum, cells
    with torch.no_grad():
        for lo, hi, n_real in eval_slices(n, st.eval_batch, rt.env.rank, rt.env.world_size):
            sums += _forward_sums(st, data.val_rows[lo:hi] if n_real else data.val_rows[:1], n_real)
            if rt.heartbeat is not None:  # each batch is progress: a long pass is not a hang
                rt.heartbeat.progress()
    if isinstance(rt.model, FSDPModule):  # FSDP2 keeps the root unsharded after a no-grad forward
        rt.model.reshard()
    all_reduce_sum(sums, rt.env)
    loss_sum, rows, abs_sum, sq_sum, cells = sums.tolist()
    return {
        "loss": loss_sum / rows,
        "mae": abs_sum / cells,
        "rmse": math.sqrt(sq_sum / cells),
        "rows": int(rows),
    }


def _forward_sums(st: TrainState, rows: np.ndarray, n_real: int) -> torch.Tensor:
    rt = st.rt
    x, y = read_rows(st.data.features, st.data.labels, rows)
    xt = torch.from_numpy(x).to(rt.env.device)
    yt = torch.from_numpy(y).to(rt.env.device)
    weights = np.zeros(len(rows), dtype=np.float32)
    weights[:n_real] = 1.0
    with rt.autocast():
        pred = rt.model(xt)
    pred = pred.float()
    loss_sum = weighted_loss_sum(rt.loss, pred, rt.core.normalize(yt), weights)
    if n_real == 0:
        return torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    err = (rt.core.denormalize(pred[:n_real]) - yt[:n_real]).double()
    return torch.tensor(
        [float(loss_sum), n_real, float(err.abs().sum()), float(err.square().sum()), err.numel()],
        dtype=torch.float64,
    )
