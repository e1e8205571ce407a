"""Benchmark: stage-data on a large float32 .npy vs a plain copy of the same arrays.

    python -m bench.bench_stage_data [--gb 1.0] [--pairs 5] [--dir /tmp/bench-stage-data] [--sha256]

Baseline: `np.load(mmap_mode="r")` -> `np.save` of the features and the labels, each file
then fsynced: the same fsync policy as staging, which fsyncs every file of the staged
directory once (scratch files are not fsynced). Subject: the real stage-data
(`enn_core.data.staging.stage`) on the same files: checks every value is finite, hashes
while writing, writes row keys and splits, accumulates train-row statistics, renames into
place. Interleaved pairs; prints the median ratio baseline_time / subject_time (target
>= 0.5), the same ratio of CPU seconds (on a shared, saturated machine wall time follows CPU
time), the load average, and the machine facts. It also times the staging hash alone
(enn_core.data.hashing.TreeHash, two threads) over the same bytes: the ceiling for any stage
that hashes what it stages; `--sha256` adds single-stream sha256 (the algorithm before).
Disk use: ~3.5x the size.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.harness import compare
from enn_core.config import load_config
from enn_core.data.hashing import TreeHash
from enn_core.data.npyio import HASH_THREADS
from enn_core.data.staging import stage
from enn_core.paths import Layout

N_FEATURES = 64


def make_input(d: Path, gb: float) -> tuple[Path, Path]:
    n = int(gb * 2**30) // (4 * N_FEATURES)
    x = np.lib.format.open_memmap(d / "x.npy", mode="w+", dtype=np.float32, shape=(n, N_FEATURES))
    y = np.lib.format.open_memmap(d / "y.npy", mode="w+", dtype=np.float32, shape=(n, 1))
    block = np.random.default_rng(0).normal(size=(1 << 16, N_FEATURES + 1)).astype(np.float32)
    for s in range(0, n, len(block)):
        c = min(len(block), n - s)
        x[s : s + c], y[s : s + c] = block[:c, :N_FEATURES], block[:c, N_FEATURES:]
    x.flush(), y.flush()
    return d / "x.npy", d / "y.npy"


def copy_fsync(src: Path, dst: Path) -> None:
    np.save(dst, np.load(src, mmap_mode="r"))
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(*paths: Path) -> None:
    for p in paths:
        arr = np.load(p, mmap_mode="r")
        h = hashlib.sha256()
        for s in range(0, len(arr), 1 << 16):
            h.update(arr[s : s + (1 << 16)])
        h.hexdigest()


def tree_hash_of(*paths: Path) -> None:
    """The staging hash over the same bytes, with the writer's threads and one chunk in flight."""
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        for p in paths:
            arr, h, pending = np.load(p, mmap_mode="r"), TreeHash(), []
            for s in range(0, len(arr), 1 << 16):
                for f in pending:
                    f.result()
                pending = [
                    pool.submit(t) for t in h.plan(memoryview(arr[s : s + (1 << 16)]).cast("B"))
                ]
            for f in pending:
                f.result()
            h.hexdigest()


def cpu_timed(fn, into: list[float]):
    """`fn`, recording the process's CPU seconds (all threads) of each call into `into`."""

    def run() -> None:
        t = time.process_time()
        fn()
        into.append(time.process_time() - t)

    return run


def compare_cpu(name: str, baseline, subject, **kw) -> dict:
    """harness.compare, plus the median ratio of CPU seconds over the same interleaved pairs."""
    cb: list[float] = []
    cs: list[float] = []
    result = compare(name, baseline=cpu_timed(baseline, cb), subject=cpu_timed(subject, cs), **kw)
    warm = kw.get("warmup", 1)
    ratios = [b / s for b, s in zip(cb[warm:], cs[warm:], strict=True)]
    result["cpu_ratio_median"] = statistics.median(ratios)
    result["cpu_baseline_median_s"] = statistics.median(cb[warm:])
    result["cpu_subject_median_s"] = statistics.median(cs[warm:])
    print(
        f"  wall median {result['baseline_median_s']:.2f}s vs {result['subject_median_s']:.2f}s; "
        f"CPU median {result['cpu_baseline_median_s']:.2f}s vs {result['cpu_subject_median_s']:.2f}s, "
        f"CPU ratio {result['cpu_ratio_median']:.3f}; load average {os.getloadavg()[0]:.1f}"
    )
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0, help="size of the features .npy in GiB")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/bench-stage-data")
    ap.add_argument("--sha256", action="store_true", help="also time single-stream sha256 alone")
    ap.add_argument("--no-ceiling", action="store_true", help="skip timing the staging hash alone")
    args = ap.parse_args()
    d = Path(args.dir)
    shutil.rmtree(d, ignore_errors=True)
    (d / "in").mkdir(parents=True)
    x, y = make_input(d / "in", args.gb)
    cfg = load_config(None, ["data.source=npy", f"data.path={x}", f"data.labels_path={y}", "data.categorical=[]",
                             "data.cyclic=[]", "data.cyclic_periods=[]", "data.cyclic_starts=[]"])  # fmt: skip
    layout = Layout.for_root(d)
    out_copy, out_stage = d / "copy", d / "outputs" / "stage-data"

    def setup() -> None:
        shutil.rmtree(out_copy, ignore_errors=True)
        shutil.rmtree(out_stage, ignore_errors=True)
        out_copy.mkdir()

    def baseline() -> None:
        copy_fsync(x, out_copy / "features.npy")
        copy_fsync(y, out_copy / "labels.npy")

    def subject() -> None:
        stage(cfg.data, layout, out_stage)

    print(
        f"input: features {x.stat().st_size / 2**30:.2f} GiB float32 [N, {N_FEATURES}], labels [N, 1]; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    ceiling = None
    if not args.no_ceiling:
        ceiling = compare_cpu("staging hash alone (tree, 2 threads): ceiling for hashing while staging",
                              baseline, lambda: tree_hash_of(x, y), pairs=args.pairs, setup=setup)  # fmt: skip
    if args.sha256:
        compare_cpu("sha256 alone, one stream (the hash before)", baseline, lambda: sha256_of(x, y),
                    pairs=args.pairs, setup=setup)  # fmt: skip
    result = compare_cpu(f"stage-data {args.gb:g} GiB npy vs np.load(mmap)+np.save+fsync", baseline, subject,
                         pairs=args.pairs, target=0.5, setup=setup)  # fmt: skip
    print(
        f"SUMMARY ratio {result['ratio_median']:.3f} (target 0.5; CPU ratio {result['cpu_ratio_median']:.3f}); "
        f"hash-only ceiling {ceiling['ratio_median'] if ceiling else float('nan'):.3f}; load average {os.getloadavg()[0]:.1f}"
    )
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
