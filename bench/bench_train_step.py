"""Training-step throughput: the runtime's loop against a hand-written loop (world size 1),
and FSDP2's steps with and without the collective timing (2 ranks on gloo).

1. Both train the same spatiotemporal ENN (39 sections x 24 hours, the real data's grid)
from the same initial weights on the same staged memmaps, with the same batch, AdamW,
warm-up + cosine schedule, gradient clipping and loss, reading each batch from the memmaps.
The runtime runs with its defaults on: the all-reduce-ready step (non-finite guard, OOM
agreement point, clip-norm bookkeeping, phase and communication timing), the heartbeat
thread, buffered per-step telemetry to an events file. Validation is off in both (empty
val split) so only steps are timed. Ratio = hand-written time / runtime time (>= 0.97 is the
target).

2. Two ranks (spawned, gloo, one thread each) hold the same model wrapped twice by the
worker's `apply_parallelism` (FSDP2); one copy's all-gathers and reduce-scatters go through
`enn_core.runtime.comm_clock`. Each run is `--fsdp-steps` forward/backward/AdamW steps on a
fixed batch, alternating copies. Ratio = untimed / timed (1.0: the timing costs nothing
measurable; >= 0.97 is the target).

    python -m bench.bench_train_step [--pairs 5] [--epochs 2] [--fsdp-pairs 7] [--fsdp-steps 8]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

from bench.harness import compare
from enn_core.config import load_config
from enn_core.data.dataset import StagedDataset
from enn_core.data.staging import stage
from enn_core.events import EventLog
from enn_core.fault import FaultInjector
from enn_core.losses import make_loss
from enn_core.model.enn import build_model
from enn_core.paths import Layout
from enn_core.runtime.comm_clock import CommClock, time_fsdp_collectives
from enn_core.runtime.dist import apply_parallelism, bootstrap, local_env, shutdown
from enn_core.runtime.heartbeat import Heartbeat
from enn_core.runtime.launch import free_port
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
    model = build_model(cfg.model, ds.manifest.model_data(), data_dir=staged).train()
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
    model = build_model(cfg.model, ds.manifest.model_data(), data_dir=staged).train()
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


def fsdp_rank(rank: int, staged: str, port: int, pairs: int, steps: int) -> None:
    """One of two ranks: the same FSDP2 model with and without the collective timing."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"
    )
    cfg = load_config(None, OVERRIDES)
    env = bootstrap(device="cpu", threads=1, seed=0, deterministic=False, pg_timeout_s=120)
    ds = StagedDataset(staged)
    models = []
    for timed in (False, True):
        torch.manual_seed(0)
        built = build_model(cfg.model, ds.manifest.model_data(), data_dir=staged)
        model, _ = apply_parallelism(built, env)
        if timed:
            time_fsdp_collectives(model, CommClock())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        models.append((model.train(), opt))
    loss_fn = make_loss(cfg.train)
    rows = ds.split("train")[rank * 16 : (rank + 1) * 16]  # 16 rows per rank: batch 32
    x = torch.from_numpy(np.asarray(ds.features[rows], dtype=np.float32))
    y = torch.from_numpy(np.asarray(ds.labels[rows], dtype=np.float32))
    norm_y = models[0][0].normalize(y)

    def run(i: int) -> None:
        model, opt = models[i]
        for _ in range(steps):
            loss_fn(model(x), norm_y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    quiet = rank != 0
    with open(os.devnull, "w") as null, contextlib.ExitStack() as stack:
        if quiet:
            stack.enter_context(contextlib.redirect_stdout(null))
            stack.enter_context(contextlib.redirect_stderr(null))
        compare(
            f"FSDP2 step on 2 ranks ({steps} steps): untimed vs collectives timed",
            baseline=lambda: run(0),
            subject=lambda: run(1),
            pairs=pairs,
            target=0.97,
        )
    models.clear()  # before destroy_process_group: the FSDP2 exit-abort fix
    shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fsdp-pairs", type=int, default=7, help="0 skips the 2-rank comparison")
    ap.add_argument("--fsdp-steps", type=int, default=8)
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
            f"{n} training rows, batch {cfg.train.batch_size}, {args.epochs} epochs per run, "
            f"{args.threads} thread(s)"
        )
        if args.pairs:
            compare(
                "train step at world size 1: hand-written loop vs runtime",
                baseline=lambda: hand_written(cfg, ds, staged),
                subject=lambda: runtime_loop(cfg, ds, staged, root / "run"),
                pairs=args.pairs,
                target=0.97,
            )
        if args.fsdp_pairs:
            spawn_args = (str(staged), free_port(), args.fsdp_pairs, args.fsdp_steps)
            mp.spawn(fsdp_rank, args=spawn_args, nprocs=2)


if __name__ == "__main__":
    main()
