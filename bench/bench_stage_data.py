"""Benchmark: stage-data on a large float32 .npy vs a plain copy of the same arrays.

    python -m bench.bench_stage_data [--gb 1.0] [--pairs 5] [--dir /tmp/bench-stage-data]

Baseline: `np.load(mmap_mode="r")` -> `np.save` of the features and the labels, then fsync
(the same fsync policy as staging, which fsyncs every file it writes). Subject: the real
stage-data (`enn_core.data.staging.stage`) on the same files: checks every value is finite,
hashes while writing, writes row keys and splits, accumulates train-row statistics, renames
into place. Interleaved pairs; prints the median ratio baseline_time / subject_time (target
>= 0.5) and the machine facts. It also times sha256 alone over the same bytes against the
baseline: the ceiling for any stage that hashes what it writes on this machine (where
sha256 is slower than the copy, that ceiling is below the target). Disk use: ~3.5x the size.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
from pathlib import Path

import numpy as np

from bench.harness import compare
from enn_core.config import load_config
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0, help="size of the features .npy in GiB")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/bench-stage-data")
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
        f"input: features {x.stat().st_size / 2**30:.2f} GiB float32 [N, {N_FEATURES}], labels [N, 1]"
    )
    # the ceiling any stage that sha256-hashes its output can reach here: baseline / hash time
    ceiling = compare("sha256 of the same bytes (ceiling for hashing while staging)", baseline=baseline,
                      subject=lambda: sha256_of(x, y), pairs=args.pairs, setup=setup)  # fmt: skip
    result = compare(f"stage-data {args.gb:g} GiB npy vs np.load(mmap)+np.save+fsync", baseline=baseline, subject=subject,
            pairs=args.pairs, target=0.5, setup=setup)  # fmt: skip
    print(
        f"SUMMARY ratio {result['ratio_median']:.3f} (target 0.5); sha256-only ceiling {ceiling['ratio_median']:.3f}"
    )
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
