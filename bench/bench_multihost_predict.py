"""Benchmark: the predict stage on two hosts against one host, at the same number of ranks.

Two hosts made on this machine (tests/fixtures/hosts.py: network, UTS, PID and mount
namespaces; needs root), each with its own checkout of one project whose staged synthetic data
has `--rows` rows, and a model trained one epoch on them. Baseline: `enn predict` on node1
with two workers (`predict.world_size=2`). Subject: `enn predict` on node1 and node2 at once,
one worker each (`runtime.nnodes=2`, the parts in a shared folder, node1 assembles). Both
predict every row with the same model and write the same outputs; pairs run interleaved through
bench.harness.compare, which prints the median ratio baseline time / subject time and the
rows per second of each.

    sudo .venv/bin/python bench/bench_multihost_predict.py [--rows 100800] [--pairs 5]

The hosts share this machine's cores: the ratio shows what crossing the network costs
(rendezvous, a process group, parts written to a shared folder and assembled by one node), not
what a second machine's cores would add. On separate machines the subject has twice the cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import compare  # noqa: E402
from tests.fixtures.hosts import TestBed, missing_capability  # noqa: E402
from tests.fixtures.project import contained_env, make_project  # noqa: E402

N_MONTHS, N_DAYTYPES, N_DIRECTIONS = 12, 7, 2  # the synthetic source's keys: rows per replicate


def sets(*overrides: str) -> list[str]:
    return [p for o in overrides for p in ("--set", o)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_800)
    ap.add_argument("--pairs", type=int, default=5)
    args = ap.parse_args()
    why = missing_capability()
    if why:
        print(f"bench_multihost_predict: {why}", file=sys.stderr)
        return 2
    replicates = max(1, -(-args.rows // (N_MONTHS * N_DAYTYPES * N_DIRECTIONS)))
    bed = TestBed.create()
    try:
        project = make_project(bed.view, None)
        project.set_params(
            [
                f"data.synthetic.n_months={N_MONTHS}",
                f"data.synthetic.n_daytypes={N_DAYTYPES}",
                f"data.synthetic.n_directions={N_DIRECTIONS}",
                f"data.synthetic.n_replicates={replicates}",
                "data.chunk_rows=65536",
            ]
        )
        project.run("enn", "stage-data", timeout=1800)
        project.run("enn", "prepare-checkpoint")
        project.run("enn", "distributed-train", "--set", "train.epochs=1", timeout=3600)
        node1, node2 = bed.start(["node1", "node2"], env=contained_env(bed.view))
        common = [
            "predict.split=all",
            "predict.chunk_rows=8192",
            "predict.batch_size=1024",
            "predict.xlsx=false",
        ]
        runs = [0]

        def one_host() -> None:
            node1.run("enn", "predict", *sets(*common, "predict.world_size=2"), timeout=1800)

        def two_hosts() -> None:
            runs[0] += 1
            multi = [
                "runtime.nnodes=2",
                f"runtime.rdzv_endpoint=node1:{bed.port(40)}",
                f"runtime.rdzv_id=bench-{runs[0]}",
                f"predict.parts_dir={bed.shared / 'parts'}",
                "predict.world_size=1",
            ]
            cmd = ["enn", "predict", *sets(*common, *multi)]
            procs = [h.popen(*cmd, log=bed.base / f"two-{h.name}.log") for h in (node1, node2)]
            codes = [p.wait(timeout=1800) for p in procs]
            if codes != [0, 0]:
                raise RuntimeError(f"two hosts failed {codes}: see {bed.base}/two-*.log")

        t0 = time.perf_counter()
        one_host()
        print(f"rows: {args.rows} requested, {N_MONTHS * N_DAYTYPES * N_DIRECTIONS * replicates}")
        print(f"one warm-up run on one host: {time.perf_counter() - t0:.1f} s")
        result = compare(
            f"predict {args.rows} rows: one host x 2 workers vs two hosts x 1 worker",
            baseline=one_host,
            subject=two_hosts,
            pairs=args.pairs,
            warmup=0,
        )
        n = N_MONTHS * N_DAYTYPES * N_DIRECTIONS * replicates
        print(
            f"rows per second (whole command): one host {n / result['baseline_median_s']:.0f}, "
            f"two hosts {n / result['subject_median_s']:.0f}"
        )
    finally:
        bed.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
