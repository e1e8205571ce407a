"""Launch cost of distributed-train, this checkout against another revision, in one run: time
from the stage call to the first finished step of every rank (2 workers, and 1), and the
steady-state throughput of 2 workers over 1.

Each measurement is a fresh Python process (as `enn distributed-train` is) running the stage
function of one source tree on the same staged data; the trees alternate (baseline, subject,
subject, baseline, ...) for `--pairs` pairs per world size, and the medians and the median of
the per-pair differences are printed. `--baseline REV` unpacks REV into a temporary
copy (`git archive`; e.g. the commit before the launch spine: the in-thread elastic agent);
without it only this checkout is measured. Steady state = samples/s of the epochs after the
first (spawn, imports and warm-up excluded).

    python -m bench.bench_launch --baseline a9bce2f [--pairs 5] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import machine_facts

ROOT = Path(__file__).resolve().parents[1]
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

# One measurement, run by the tree on sys.path[0]: only APIs both trees have.
ONE_RUN = r"""
import json, statistics, sys, threading, time, uuid
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from enn_core.config import load_config
from enn_core.paths import Layout
from enn_core.runtime.heartbeat import read_heartbeats
from enn_core.stage import make_context
from enn_core.stages import DISTRIBUTED_TRAIN
root, world, overrides = Path(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
layout = Layout.for_root(root)
cfg = load_config(None, [*overrides, f"runtime.world_size={world}"])
ctx = make_context(cfg, layout, DISTRIBUTED_TRAIN, uuid.uuid4().hex[:8])
first = {}
done = threading.Event()
def watch(t0):
    while not done.is_set():
        beats = read_heartbeats(ctx.run_dir)
        if len(beats) == world and all(
            b["phase"] == "step" and (b["step"] or 0) >= 1 for b in beats.values()
        ):
            first["s"] = time.perf_counter() - t0
            return
        time.sleep(0.02)
t0 = time.perf_counter()
threading.Thread(target=watch, args=(t0,), daemon=True).start()
summary = DISTRIBUTED_TRAIN.work(cfg, ctx)
wall = time.perf_counter() - t0
done.set()
history = json.loads((DISTRIBUTED_TRAIN.output_dir(layout) / "history.json").read_text())
steady = statistics.median(e["samples_per_s"] for e in history["epochs"][1:])
print("RESULT " + json.dumps({"first_step_s": first.get("s"), "wall_s": wall, "steady": steady}))
"""


def one_run(tree: Path, root: Path, world: int, epochs: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            ONE_RUN,
            str(tree),
            str(root),
            str(world),
            json.dumps([*OVERRIDES, f"train.epochs={epochs}"]),
        ],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{tree} world {world} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def setup_project(root: Path) -> None:
    from enn_core.config import load_config
    from enn_core.data.staging import run as stage_data
    from enn_core.paths import Layout
    from enn_core.stage import make_context
    from enn_core.stages import PREPARE_CHECKPOINT, STAGE_DATA

    (root / "params.yaml").write_text("{}\n")
    layout = Layout.for_root(root)
    cfg = load_config(None, OVERRIDES)
    stage_data(cfg, make_context(cfg, layout, STAGE_DATA, "setup"))
    PREPARE_CHECKPOINT.work(cfg, make_context(cfg, layout, PREPARE_CHECKPOINT, "setup"))


def summarize(
    runs: dict[str, dict[int, list[dict]]], trees: list[str], worlds: list[int], pairs: int
) -> dict:
    result: dict = {"machine": machine_facts(), "pairs": pairs}
    for name in trees:
        for world in worlds:
            rs = runs[name][world]
            result[f"{name}_first_step_s_{world}w_median"] = statistics.median(
                r["first_step_s"] for r in rs
            )
        if 1 in worlds and 2 in worlds:
            ratios = [
                b["steady"] / a["steady"] for a, b in zip(runs[name][1], runs[name][2], strict=True)
            ]
            result[f"{name}_steady_2_over_1_median"] = statistics.median(ratios)
    if "baseline" in trees:
        for world in worlds:
            diffs = [
                s["first_step_s"] - b["first_step_s"]
                for b, s in zip(runs["baseline"][world], runs["subject"][world], strict=True)
            ]
            result[f"first_step_subject_minus_baseline_{world}w_median_s"] = statistics.median(
                diffs
            )
            base = result[f"baseline_first_step_s_{world}w_median"]
            result[f"first_step_subject_over_baseline_{world}w"] = (
                result[f"subject_first_step_s_{world}w_median"] / base
            )
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="", help="a git revision to compare against")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--worlds", default="2,1")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "proj"
        root.mkdir()
        setup_project(root)
        trees = {"subject": ROOT}
        if args.baseline:  # the revision's files (git archive: the repository is not changed)
            trees["baseline"] = Path(tmp) / "baseline"
            trees["baseline"].mkdir()
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.baseline],
                check=True,
                capture_output=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(trees["baseline"])], input=archive, check=True)
        runs: dict[str, dict[int, list[dict]]] = {t: {w: [] for w in worlds} for t in trees}
        for i in range(args.pairs):
            for world in worlds:
                order = list(trees) if i % 2 == 0 else list(reversed(trees))
                for name in order:
                    r = one_run(trees[name], root, world, args.epochs)
                    runs[name][world].append(r)
                    print(f"pair {i} world {world} {name}: {r}", flush=True)
    result = summarize(runs, list(trees), worlds, args.pairs)
    for k, v in result.items():
        if k != "machine":
            print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    print(json.dumps(result, indent=2), file=sys.stderr)


if __name__ == "__main__":
    main()
