"""Training throughput on a large table: the runtime's loop against a hand-written PyTorch loop
over the same memmaps, at the same batch, world size 1, in the same process.

The table is what a user brings (issue 51): a categorical of 500 stores, a cyclic weekday, a
numeric temperature and 24 label columns h00..h23, written as CSV with pyarrow's writer into
a temporary folder and staged with the project's stage-data (`enn_core.data.staging.stage`).
Both loops train the `tabular` preset (about 14k parameters) from the same initial weights
with AdamW, the warm-up + cosine schedule, gradient clipping and the l1 loss, reading each
batch from the staged memmaps in a seeded shuffled order. The runtime runs as a worker does
(non-finite guard, agreement points, clip bookkeeping, phase timing, the heartbeat thread,
buffered per-step telemetry to an events file), for `--steps` optimizer steps
(`train.max_steps`), with no validation rows. Ratio = hand-written time / runtime time, i.e.
the runtime's rows/s as a share of the hand-written loop's (target >= 0.9).

    python -m bench.bench_train_loop [--rows 1000000] [--batch 4096] [--steps 60] [--pairs 5]
"""

from __future__ import annotations

import argparse
import tempfile
import time
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

LABELS = [f"h{h:02d}" for h in range(24)]


def write_table(path: Path, n: int, seed: int = 0) -> None:
    """A CSV of `n` rows (store, weekday, temp, h00..h23) with pyarrow's writer, in blocks."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    rng = np.random.default_rng(seed)
    level = rng.normal(50, 10, 500)
    writer = None
    try:
        for lo in range(0, n, 250_000):
            m = min(250_000, n - lo)
            store = rng.integers(0, 500, m)
            weekday = rng.integers(0, 7, m)
            temp = rng.normal(15, 8, m).round(2)
            hours = np.arange(24)
            base = level[store][:, None] + 5 * np.sin(2 * np.pi * hours / 24)[None, :]
            y = (
                base
                + 0.3 * temp[:, None]
                - 2.0 * (weekday[:, None] >= 5)
                + rng.normal(0, 1, (m, 24))
            )
            cols = {
                "store": pa.array([f"s{s:03d}" for s in store]),
                "weekday": pa.array(weekday),
                "temp": pa.array(temp),
                **{name: pa.array(y[:, h].round(3)) for h, name in enumerate(LABELS)},
            }
            table = pa.table(cols)
            if writer is None:
                writer = pacsv.CSVWriter(str(path), table.schema)
            writer.write_table(table)
    finally:
        if writer is not None:
            writer.close()


def overrides(csv: Path, batch: int, steps: int) -> list[str]:
    return [
        "data.source=csv",
        f"data.path={csv}",
        "data.feature_columns=[store,weekday,temp]",
        "data.categorical=[store,weekday]",
        "data.cyclic=[weekday]",
        "data.cyclic_periods=[7]",
        "data.cyclic_starts=[0]",
        f"data.label_columns=[{','.join(LABELS)}]",
        "data.label_shape=[24]",
        "data.label_axes=[hour]",
        "data.naive_keys=[weekday]",
        "model.preset=tabular",
        "train.loss=l1",
        "train.lr=0.001",
        "train.weight_decay=0.1",
        f"train.batch_size={batch}",
        "train.epochs=1",
        f"train.max_steps={steps}",
        "train.patience=0",
    ]


def hand_written(cfg, ds: StagedDataset, staged: Path, steps: int) -> None:
    """What a practitioner writes: shuffle, sorted fancy-index reads from the memmaps, AdamW."""
    model = build_model(cfg.model, ds.manifest.model_data(), data_dir=staged).train()
    loss_fn = make_loss(cfg.train, cfg.model.preset)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, foreach=True
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda k: lr_factor(
            k, total_steps=steps, warmup_steps=cfg.train.warmup_steps, min_lr_ratio=0.05
        ),
    )
    batch = cfg.train.batch_size
    order = np.random.default_rng([cfg.runtime.seed, 0]).permutation(ds.split("train"))
    for s in range(steps):
        idx = np.sort(order[s * batch : (s + 1) * batch])
        x = torch.from_numpy(np.asarray(ds.features[idx], dtype=np.float32))
        y = torch.from_numpy(np.asarray(ds.labels[idx], dtype=np.float32))
        loss = loss_fn(model(x), model.normalize(y)).mean()
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
        loss=make_loss(cfg.train, cfg.model.preset),
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
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="cProfile one runtime run instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "params.yaml").write_text("{}\n")
        csv = root / "table.csv"
        t0 = time.perf_counter()
        write_table(csv, args.rows)
        cfg = load_config(None, overrides(csv, args.batch, args.steps))
        staged = root / "outputs" / "stage-data"
        stage(cfg.data, Layout.for_root(root), staged)
        ds = StagedDataset(staged)
        n = len(ds.split("train"))
        print(
            f"{args.rows} rows ({n} training) written and staged in "
            f"{time.perf_counter() - t0:.0f} s; batch {args.batch}, {args.steps} steps per run, "
            f"{args.threads} thread(s)"
        )
        if args.profile:
            import cProfile
            import pstats

            runtime_loop(cfg, ds, staged, root / "warm")
            prof = cProfile.Profile()
            prof.runcall(runtime_loop, cfg, ds, staged, root / "run")
            pstats.Stats(prof).sort_stats("tottime").print_stats(40)
            return
        rows = args.batch * args.steps
        result = compare(
            "train loop at world size 1: hand-written loop vs runtime (rows/s ratio)",
            baseline=lambda: hand_written(cfg, ds, staged, args.steps),
            subject=lambda: runtime_loop(cfg, ds, staged, root / "run"),
            pairs=args.pairs,
            target=0.9,
        )
        for name, key in (("hand-written", "baseline_median_s"), ("runtime", "subject_median_s")):
            print(f"{name}: {rows / result[key]:,.0f} rows/s (median of {args.pairs})")


if __name__ == "__main__":
    main()
