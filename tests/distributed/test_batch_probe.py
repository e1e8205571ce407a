"""`train.micro_batch: auto` across ranks: two gloo processes that measured different
micro-batches agree on the smallest (the probe itself: tests/unit/runtime/test_batch_probe.py;
through the stage: test_auto_micro_batch_stage.py)."""

from __future__ import annotations

import torch

from enn_core.runtime.batch_probe import MicroBatchChoice, agree_choice


def _agree_worker(rank: int, store_path: str, values: list[int], out: str) -> None:
    import json

    import torch.distributed as dist

    from enn_core.runtime.dist import DistEnv

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    env = DistEnv(rank, 2, rank, torch.device("cpu"), "gloo", 0, None)
    mine = MicroBatchChoice(values[rank], f"rank {rank} measured", {"rank": rank})
    got = agree_choice(mine, env)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(
            {"micro_batch": got.micro_batch, "reason": got.reason, "measured": got.measured}, f
        )
    dist.destroy_process_group()


def test_ranks_agree_on_the_smallest_choice(tmp_path):
    import json

    import torch.multiprocessing as mp

    out = str(tmp_path / "agreed")
    mp.spawn(_agree_worker, args=(str(tmp_path / "store"), [8, 4], out), nprocs=2, join=True)
    r0, r1 = (json.loads(open(f"{out}.{r}").read()) for r in (0, 1))
    assert r0["micro_batch"] == r1["micro_batch"] == 4
    assert r0["reason"].endswith("lowered to 4, the smallest choice of any rank")
    assert r0["measured"]["this_rank_micro_batch"] == 8 and r1["reason"] == "rank 1 measured"
