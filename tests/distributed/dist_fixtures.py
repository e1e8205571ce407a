"""A tiny project (staged data + initial checkpoint) and a way to run distributed-train on
it with real elastic workers on gloo."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psutil
import torch

from enn_core.config import RunConfig, load_config
from enn_core.data.staging import run as stage_data
from enn_core.paths import Layout
from enn_core.runtime.heartbeat import read_heartbeats
from enn_core.stage import make_context
from enn_core.stages import DISTRIBUTED_TRAIN, PREPARE_CHECKPOINT, STAGE_DATA

TINY = [
    "data.synthetic.n_months=4",
    "data.synthetic.n_daytypes=2",
    "data.synthetic.n_directions=2",
    "data.synthetic.n_sections=4",
    "data.synthetic.n_hours=6",
    "model.d_model=16",
    "model.heads=2",
    "model.layers=2",
    "model.embed_dim=4",
    "train.epochs=2",
    "train.batch_size=8",
    "train.warmup_steps=2",
    "train.patience=0",
    "runtime.world_size=2",
    "runtime.hang_timeout_s=60",
    "runtime.pg_timeout_s=60",
    "runtime.pg_timeout_steady_s=60",
    "runtime.progress=false",
    "runtime.threads_per_worker=1",
]


def cfg_of(*extra: str) -> RunConfig:
    return load_config(None, [*TINY, *extra], allow_faults=True)


def make_project(root: Path, *extra: str) -> Layout:
    """Staged data and init.pt under `root` (in process, no workers); `extra` overrides the
    tiny shapes (train with the same overrides)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text("{}\n")
    layout = Layout.for_root(root)
    cfg = cfg_of(*extra)
    stage_data(cfg, make_context(cfg, layout, STAGE_DATA, "setup"))
    PREPARE_CHECKPOINT.work(cfg, make_context(cfg, layout, PREPARE_CHECKPOINT, "setup"))
    return layout


def run_train(layout: Layout, cfg: RunConfig) -> tuple[dict, Path]:
    """distributed-train through its stage function; returns (its summary as result.json
    holds it: the workers' record with the stage's fields, run dir)."""
    run_id = uuid.uuid4().hex[:8]
    ctx = make_context(cfg, layout, DISTRIBUTED_TRAIN, run_id)
    return DISTRIBUTED_TRAIN.work(cfg, ctx).as_dict(), ctx.run_dir


def outputs(layout: Layout) -> tuple[dict, dict[str, torch.Tensor]]:
    out = DISTRIBUTED_TRAIN.output_dir(layout)
    history = json.loads((out / "history.json").read_text())
    ckpt = torch.load(out / "model.pt", weights_only=True)
    return history, ckpt["state_dict"]


def worker_pids(run_dir: Path) -> list[int]:
    return [int(h["pid"]) for h in read_heartbeats(run_dir).values()]


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out
