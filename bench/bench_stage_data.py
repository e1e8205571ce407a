"""Benchmark: stage-data on a large float32 .npy vs a plain copy of the same arrays.

    python -m bench.bench_stage_data [--gb 1.0] [--pairs 5] [--dir /tmp/bench-stage-data]
                                     [--hashes] [--no-ceiling]

Baseline: `np.load(mmap_mode="r")` -> `np.save` of the features and the labels, each file
then fsynced: the same fsync policy as staging, which fsyncs every file of the staged
directory once (scratch files are not fsynced). Subject: the real stage-data
(`enn_core.data.staging.stage`) on the same files: checks every value is finite, hashes
while writing, writes row keys and splits, accumulates train-row statistics, renames into
place. Interleaved pairs; prints the median ratio baseline_time / subject_time (target
>= 0.5), the user and system CPU seconds of each side (system CPU, the kernel's page-cache
work, is paid by both and is what varies between runs), the load average and the machine
facts; and the peak growth of anonymous memory while staging (RssAnon sampled every
millisecond, enn_core.runtime.memory.sampled_anon_peak; memmap file pages excluded) against
the streaming bound of 64 MB plus two chunks (`--gb 2` is the issue's 2 GB check). It also
times the staging hash alone (enn_core.data.hashing's BLAKE3, one thread, as the writer runs
it) over the same bytes: the ceiling for any stage that hashes what it stages (`--no-ceiling`
skips it). `--hashes`
prints each candidate algorithm's single-core rate (sha256, BLAKE2b-256, BLAKE3), the
figures behind the choice. Disk use: ~3.5x the size.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from bench.harness import compare
from enn_core.config import load_config
from enn_core.data import hashing
from enn_core.data.staging import stage
from enn_core.paths import Layout
from enn_core.runtime.memory import sampled_anon_peak

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


def hash_of(make, *paths: Path) -> None:
    """Hash the arrays' data bytes in chunks of 64 Ki rows, as the staging writer does."""
    for p in paths:
        arr, h = np.load(p, mmap_mode="r"), make()
        for s in range(0, len(arr), 1 << 16):
            h.update(memoryview(arr[s : s + (1 << 16)]).cast("B"))
        h.hexdigest()


HASHES = {
    "sha256": hashlib.sha256,
    "blake2b-256": lambda: hashlib.blake2b(digest_size=32),
    "blake3 (staging)": hashing.new,
}


def hash_rates(*paths: Path) -> None:
    """Each algorithm's single-core rate over the same (page-cached) bytes, best of 3."""
    size = sum(p.stat().st_size for p in paths)
    for name, make in HASHES.items():
        best = min(_cpu_seconds(lambda make=make: hash_of(make, *paths)) for _ in range(3))
        print(f"  {name:18s} {size / best / 1e9:5.2f} GB/s a core")


def _cpu_seconds(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def anon_peak(fn, peaks: list[float]):
    """`fn`, recording the anonymous memory it grew by at its peak, in MB (RssAnon sampled
    every millisecond: enn_core.runtime.memory.sampled_anon_peak; memmap pages excluded)."""

    def run() -> None:
        gc.collect()
        peaks.append(sampled_anon_peak(fn).bytes / 2**20)

    return run


def cpu_timed(fn, into: list[tuple[float, float]]):
    """`fn`, recording the process's (user, system) CPU seconds (all threads) of each call."""

    def run() -> None:
        t = os.times()
        fn()
        u = os.times()
        into.append((u.user - t.user, u.system - t.system))

    return run


def compare_cpu(name: str, baseline, subject, **kw) -> dict:
    """harness.compare, plus the CPU seconds of the same interleaved pairs, user and system.

    User CPU is the work each side does itself (staging: checks, hash, statistics); system
    CPU is mostly the kernel putting written pages into the page cache, which both sides
    pay and which varies several-fold between runs on these VMs (page reclaim): it, not
    the user work, is what makes the wall ratio noisy.
    """
    cb: list[tuple[float, float]] = []
    cs: list[tuple[float, float]] = []
    result = compare(name, baseline=cpu_timed(baseline, cb), subject=cpu_timed(subject, cs), **kw)
    warm = kw.get("warmup", 1)
    cb, cs = cb[warm:], cs[warm:]
    result["cpu_ratio_median"] = statistics.median(
        (bu + bs) / (su + ss) for (bu, bs), (su, ss) in zip(cb, cs, strict=True)
    )
    for side, rec in (("baseline", cb), ("subject", cs)):
        result[f"cpu_user_{side}_median_s"] = statistics.median(u for u, _ in rec)
        result[f"cpu_system_{side}_median_s"] = statistics.median(s for _, s in rec)
    print(
        f"  wall median {result['baseline_median_s']:.2f}s vs {result['subject_median_s']:.2f}s; "
        f"user CPU median {result['cpu_user_baseline_median_s']:.2f}s "
        f"vs {result['cpu_user_subject_median_s']:.2f}s; "
        f"system CPU median {result['cpu_system_baseline_median_s']:.2f}s "
        f"vs {result['cpu_system_subject_median_s']:.2f}s; "
        f"CPU ratio {result['cpu_ratio_median']:.3f}; load average {os.getloadavg()[0]:.1f}"
    )
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0, help="size of the features .npy in GiB")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/bench-stage-data")
    ap.add_argument("--hashes", action="store_true", help="print each hash algorithm's rate a core")
    ap.add_argument("--no-ceiling", action="store_true", help="skip timing the staging hash alone")
    args = ap.parse_args()
    d = Path(args.dir)
    shutil.rmtree(d, ignore_errors=True)
    (d / "in").mkdir(parents=True)
    x, y = make_input(d / "in", args.gb)
    cfg = load_config(
        None,
        [
            "data.source=npy",
            f"data.path={x}",
            f"data.labels_path={y}",
            "data.categorical=[]",
            "data.cyclic=[]",
            "data.cyclic_periods=[]",
            "data.cyclic_starts=[]",
        ],
    )
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
        f"input: features {x.stat().st_size / 2**30:.2f} GiB float32 [N, {N_FEATURES}], "
        "labels [N, 1]; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    if args.hashes:
        hash_rates(x, y)
    ceiling = None
    if not args.no_ceiling:
        ceiling = compare_cpu(
            "staging hash alone (BLAKE3, one thread): ceiling for hashing while staging",
            baseline,
            lambda: hash_of(hashing.new, x, y),
            pairs=args.pairs,
            setup=setup,
        )
    peaks: list[float] = []
    result = compare_cpu(
        f"stage-data {args.gb:g} GiB npy vs np.load(mmap)+np.save+fsync",
        baseline,
        anon_peak(subject, peaks),
        pairs=args.pairs,
        target=0.5,
        setup=setup,
    )
    chunk_mb = (
        cfg.data.chunk_rows * (N_FEATURES + 1) * 8 / 2**20
    )  # a chunk as float64, as tests bound it
    print(
        f"  anonymous memory while staging: peak {max(peaks):.1f} MB above the level before "
        "the call "
        f"(bound 64 MB + two chunks = {64 + 2 * chunk_mb:.0f} MB)"
    )
    print(
        f"SUMMARY ratio {result['ratio_median']:.3f} "
        f"(target 0.5; CPU ratio {result['cpu_ratio_median']:.3f}); "
        f"hash-only ceiling {ceiling['ratio_median'] if ceiling else float('nan'):.3f}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
