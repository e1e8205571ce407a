"""Launch cost and scaling of distributed-train: time from the stage call to the first
finished step with 2 workers (and with 1), and steady-state throughput with 2 workers over 1.

Runs alternate 1-worker and 2-worker jobs (>= 5 pairs) on the same staged data; threads per
worker are the runtime's default (cores // world size). Steady state = samples/s of the
epochs after the first (spawn, imports and warm-up excluded).

    python -m bench.bench_launch [--pairs 5] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from bench.harness import machine_facts
from enn_core.config import load_config
from enn_core.data.staging import run as stage_data
from enn_core.paths import Layout
from enn_core.runtime.heartbeat import read_heartbeats
from enn_core.stage import make_context
from enn_core.stages import DISTRIBUTED_TRAIN, PREPARE_CHECKPOINT, STAGE_DATA

OVERRIDES = [
    "data.synthetic.n_sections=12",
    "data.synthetic.n_hours=24",
    "data.synthetic.n_replicates=4",
    "model.d_model=16",
    "model.heads=2",
    "model.layers=2",
    "train.batch_size=32",
    "train.patience=0",
    "runtime.progress=false",
]


def one_run(layout: Layout, world: int, epochs: int) -> dict:
    cfg = load_config(None, [*OVERRIDES, f"train.epochs={epochs}", f"runtime.world_size={world}"])
    ctx = make_context(cfg, layout, DISTRIBUTED_TRAIN, uuid.uuid4().hex[:8])
    first: dict[str, float] = {}
    done = threading.Event()

    def watch(t0: float) -> None:  # first moment every rank has finished a step
        while not done.is_set():
            beats = read_heartbeats(ctx.run_dir)
            if len(beats) == world and all(
                b["phase"] == "step" and (b["step"] or 0) >= 1 for b in beats.values()
            ):
                first["s"] = time.perf_counter() - t0
                return
            time.sleep(0.05)

    t0 = time.perf_counter()
    threading.Thread(target=watch, args=(t0,), daemon=True).start()
    summary = DISTRIBUTED_TRAIN.work(cfg, ctx)
    done.set()
    history = json.loads((DISTRIBUTED_TRAIN.output_dir(layout) / "history.json").read_text())[
        "epochs"
    ]
    steady = statistics.median(e["samples_per_s"] for e in history[1:])
    return {
        "first_step_s": first.get("s"),
        "wall_s": summary["wall_s"],
        "steady_samples_per_s": steady,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "params.yaml").write_text("{}\n")
        layout = Layout.for_root(root)
        cfg = load_config(None, OVERRIDES)
        stage_data(cfg, make_context(cfg, layout, STAGE_DATA, "setup"))
        PREPARE_CHECKPOINT.work(cfg, make_context(cfg, layout, PREPARE_CHECKPOINT, "setup"))
        runs: dict[int, list[dict]] = {1: [], 2: []}
        for i in range(args.pairs):
            for world in (1, 2) if i % 2 == 0 else (2, 1):
                runs[world].append(one_run(layout, world, args.epochs))
                print(f"pair {i} world {world}: {runs[world][-1]}", flush=True)
        ratios = [
            b["steady_samples_per_s"] / a["steady_samples_per_s"]
            for a, b in zip(runs[1], runs[2], strict=True)
        ]
        result = {
            "first_step_s_2_workers_median": statistics.median(r["first_step_s"] for r in runs[2]),
            "first_step_s_1_worker_median": statistics.median(r["first_step_s"] for r in runs[1]),
            "steady_throughput_2_over_1_median": statistics.median(ratios),
            "ratios": ratios,
            "machine": machine_facts(),
        }
        print(
            f"time to first step: 2 workers {result['first_step_s_2_workers_median']:.1f} s, "
            f"1 worker {result['first_step_s_1_worker_median']:.1f} s (medians of {args.pairs}); "
            f"steady throughput 2 over 1: {result['steady_throughput_2_over_1_median']:.2f}"
        )
        print(json.dumps(result, indent=2), file=sys.stderr)


if __name__ == "__main__":
    main()
