"""Asynchronous checkpoint saves share one stager (its staging buffers are reused): each
checkpoint must still hold the values of its own save call, not an earlier save's (stale
buffers) nor a later step's (training changes the weights in place while a save uploads)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp

from enn_core.config import CheckpointConfig
from enn_core.train.ckpt import Checkpointer, committed, step_name


def test_async_saves_reuse_one_stager_and_hold_their_own_values(tmp_path):
    warnings.filterwarnings("ignore", category=FutureWarning)  # async_save is experimental
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    ck = Checkpointer(
        tmp_path / "ck", CheckpointConfig(async_save=True, keep_last=5), rank=0, distributed=False
    )
    assert ck.prepare(resume=True) is None
    expected, stagers = {}, []
    for position in (1, 2, 3):
        with torch.no_grad():  # a training step: the same tensors, changed in place
            for p in model.parameters():
                p.mul_(1.5).add_(position)
        expected[position] = {k: v.clone() for k, v in model.state_dict().items()}
        ck.save({"model": model.state_dict()}, {"position": position}, position)
        stagers.append(ck.stager)
    with torch.no_grad():  # and training goes on while the last save uploads
        for p in model.parameters():
            p.zero_()
    ck.complete()
    assert stagers[0] is not None and all(s is stagers[0] for s in stagers)
    assert [p.name for p in committed(tmp_path / "ck")] == [step_name(i) for i in (1, 2, 3)]
    for position, want in expected.items():
        back = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
        dcp.load(back, checkpoint_id=str(tmp_path / "ck" / step_name(position)))
        for k, v in want.items():
            assert torch.equal(back["model"][k], v), f"step {position}: {k} is not its own value"
    ck.close()
    assert ck.stager is None
