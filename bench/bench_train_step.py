"""Training-step throughput at world size 1: the runtime's loop against a hand-written loop.

Both train the same spatiotemporal ENN (39 sections x 24 hours, the real data's grid) from
the same initial weights on the same staged memmaps, with the same batch, AdamW, warm-up +
cosine schedule, gradient clipping and loss, reading each batch from the memmaps. The
runtime runs with its defaults on: the all-reduce-ready step (non-finite guard, OOM
agreement point, clip-norm bookkeeping), the heartbeat thread, buffered per-step telemetry
to an events file. Validation is off in both (empty val split) so only steps are timed.

    python -m bench.bench_train_step [--pairs 5] [--epochs 2]

Ratio = hand-written time / runtime time (>= 0.9 is the target).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.harness import compare
from enn_core.config import load_config
from enn_core.data.dataset import StagedDataset
from enn_core.data.staging import stage
from enn_core.events import EventLog
from enn_core.fault import FaultInjector
from enn_core.losses import make_loss
from enn_core.model.enn import build_model
from enn_core.paths import Layout
from enn_core.runtime.dist import local_env
from enn_core.runtime.heartbeat import Heartbeat
from enn_core.train.loop import Runtime, TrainData, train
from enn_core.train.schedule import lr_factor

OVERRIDES = [
    "data.synthetic.n_sections=39",
    "data.synthetic.n_hours=24",
    "data.synthetic.n_replicates=4",
    "model.d_model=32",
    "model.heads=4",
    "model.layers=2",
    "train.batch_size=32",
    "train.clip_norm=1.0",
    "train.patience=0",
]


def hand_written(cfg, ds: StagedDataset, staged: Path) -> None:
    model = build_model(cfg.model, ds.manifest, data_dir=staged).train()
    loss_fn = make_loss(cfg.train)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, foreach=True
    )
    rows = ds.split("train")
    steps = -(-len(rows) // cfg.train.batch_size)
    total = steps * cfg.train.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda k: lr_factor(
            k,
            total_steps=total,
            warmup_steps=cfg.train.warmup_steps,
            min_lr_ratio=cfg.train.min_lr_ratio,
        ),
    )
    for epoch in range(cfg.train.epochs):
        order = np.random.default_rng([cfg.runtime.seed, epoch]).permutation(rows)
        for s in range(steps):
            idx = np.sort(order[s * cfg.train.batch_size : (s + 1) * cfg.train.batch_size])
            x = torch.from_numpy(np.asarray(ds.features[idx], dtype=np.float32))
            y = torch.from_numpy(np.asarray(ds.labels[idx], dtype=np.float32))
            loss = loss_fn(model(x), model.normalize(y))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)


def runtime_loop(cfg, ds: StagedDataset, staged: Path, run_dir: Path) -> None:
    model = build_model(cfg.model, ds.manifest, data_dir=staged).train()
    hb = Heartbeat(run_dir, 0).start()
    rt = Runtime(
        env=local_env(),
        model=model,
        core=model,
        loss=make_loss(cfg.train),
        run_dir=run_dir,
        events=EventLog(run_dir),
        faults=FaultInjector(cfg.fault),
        heartbeat=hb,
    )
    data = TrainData(ds.features, ds.labels, ds.split("train"), ds.split("train")[:0])
    train(cfg.train, data, rt, seed=cfg.runtime.seed, log_every=cfg.train.log_every)
    hb.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(None, [*OVERRIDES, f"train.epochs={args.epochs}"])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "params.yaml").write_text("{}\n")
        staged = root / "outputs" / "stage-data"
        stage(cfg.data, Layout.for_root(root), staged)
        ds = StagedDataset(staged)
        n = len(ds.split("train"))
        print(
            f"{n} training rows, batch {cfg.train.batch_size}, {args.epochs} epochs per run, {args.threads} thread(s)"
        )
        compare(
            "train step at world size 1: hand-written loop vs runtime",
            baseline=lambda: hand_written(cfg, ds, staged),
            subject=lambda: runtime_loop(cfg, ds, staged, root / "run"),
            pairs=args.pairs,
            target=0.9,
        )


if __name__ == "__main__":
    main()
