"""Tiny staged data and an in-process world-size-1 runtime for the training-loop tests.

The loop runs exactly as in a 1-worker job (`local_env()`: no process group, every agreement
helper is the identity); the model is the real ENN (tiny), the data a real staged dataset,
and, when asked, the checkpoints real DCP saves in one process.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from enn_core.config import FaultConfig, RunConfig, load_config
from enn_core.data.dataset import StagedDataset
from enn_core.data.staging import stage
from enn_core.events import EventLog
from enn_core.fault import FaultInjector
from enn_core.losses import make_loss
from enn_core.model.enn import build_model
from enn_core.paths import Layout
from enn_core.runtime.dist import local_env, set_deterministic
from enn_core.train.ckpt import Checkpointer
from enn_core.train.loop import Runtime, TrainData, TrainResult, train
from enn_core.train.worker import full_state

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
]


def tiny_cfg(*extra: str) -> RunConfig:
    return load_config(None, [*TINY, *extra], allow_faults=True)


def staged_dir(root: Path, cfg: RunConfig | None = None) -> Path:
    cfg = cfg or tiny_cfg()
    (root / "params.yaml").write_text("{}\n")
    out = root / "outputs" / "stage-data"
    if not (out / "manifest.json").exists():
        stage(cfg.data, Layout.for_root(root), out)
    return out


def with_fault(cfg: RunConfig, **fault) -> RunConfig:
    return dataclasses.replace(cfg, fault=FaultConfig(**fault))


def run_local(
    cfg: RunConfig,
    staged: Path,
    run_dir: Path,
    *,
    threads: int = 1,
    checkpoints: Path | None = None,
) -> tuple[TrainResult, Runtime]:
    """Train in this process at world size 1; returns the result and the runtime (model).

    With `checkpoints` (a directory), DCP checkpoints are saved there as the worker saves
    them, and the newest committed one is resumed."""
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.runtime.seed)
    set_deterministic(cfg.runtime.deterministic)
    ds = StagedDataset(staged)
    model = build_model(cfg.model, ds.manifest, data_dir=staged).train()
    env = local_env()
    events = EventLog(run_dir)
    ckpt, resume_from = None, None
    if checkpoints is not None:
        ckpt = Checkpointer(
            checkpoints, cfg.checkpoint, rank=0, distributed=False, on_event=events.event
        )
        resume_from = ckpt.prepare(resume=cfg.checkpoint.resume, keep=True)
    rt = Runtime(
        env=env,
        model=model,
        core=model,
        loss=make_loss(cfg.train),
        run_dir=run_dir,
        events=events,
        faults=FaultInjector(cfg.fault, marker_dir=run_dir / "faults"),
        full_state=lambda: full_state(model, env),
        checkpointer=ckpt,
    )
    data = TrainData(ds.features, ds.labels, ds.split("train"), ds.split("val"))
    try:
        result = train(
            cfg.train,
            data,
            rt,
            seed=cfg.runtime.seed,
            log_every=cfg.train.log_every,
            resume_from=resume_from,
        )
        if ckpt is not None:
            ckpt.complete()
    finally:
        if ckpt is not None:
            ckpt.close()
    return result, rt
