"""Asynchronous checkpoint saves share one stager (its staging buffers are reused): each
checkpoint must still hold the values of its own save call, not an earlier save's (stale
buffers) nor a later step's (training changes the weights in place while a save uploads).
`checkpoint.async_staging=per_save` frees the staged copy once its save is written."""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp

from enn_core.config import CheckpointConfig
from enn_core.runtime.memory import _proc_status_kb, _release_free_heap
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


def _held_after_save(root, staging: str) -> tuple[int, int, list[torch.Tensor]]:
    """(RssAnon growth once a save is written and committed, the state's bytes, the saved
    weights) for an asynchronous save of 4 layers of 768 x 768 under AdamW."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(768, 768) for _ in range(4)))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 768)).sum().backward()
    opt.step()  # AdamW's two moments exist: the state is 3x the weights
    nbytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = CheckpointConfig(async_save=True, async_staging=staging, keep_last=5)
    ck = Checkpointer(root, cfg, rank=0, distributed=False)
    ck.prepare(resume=False)
    _release_free_heap()
    before = _proc_status_kb("RssAnon")["RssAnon"] * 1024
    ck.save({"model": model.state_dict(), "optim": opt.state_dict()}, {"position": 1}, 1)
    ck.wait()  # written and committed
    _release_free_heap()
    held = _proc_status_kb("RssAnon")["RssAnon"] * 1024 - before
    saved = [p.detach().clone() for p in model.parameters()]
    ck.close()
    return held, nbytes, saved


def test_per_save_staging_frees_the_staged_copy_once_the_save_is_written(tmp_path):
    held, nbytes, _ = _held_after_save(tmp_path / "kept", "kept")
    assert held > 0.8 * nbytes, (held, nbytes)  # the default keeps one copy of the state
    held, nbytes, saved = _held_after_save(tmp_path / "per_save", "per_save")
    assert held < 0.2 * nbytes, (held, nbytes)  # per_save: none once written (before: 1x)
    [step] = committed(tmp_path / "per_save")
    back = {"model": {f"{i}.weight": torch.zeros(768, 768) for i in range(4)}}
    dcp.load(back, checkpoint_id=str(step))
    for i in range(4):
        assert torch.equal(back["model"][f"{i}.weight"], saved[2 * i])
