"""A study shared by two hosts against the same study on one host: wall time and trials per
minute, on the multi-host test bed (tests/fixtures/hosts.py: hosts made of namespaces on this
machine, PostgreSQL on node3; needs root).

Each round runs three studies of `--trials` short trials (the tiny project, 2 epochs, no
pruning, one trial at a time per host, one thread per worker), each in a new study of the same
PostgreSQL database, in a rotating order:

- one host: `enn tune` on node1 (tune.parallel=1), the baseline;
- two hosts: the same `enn tune` on node1 and node2 at once (tune.parallel=1 each);
- one host, two slots: node1 alone with tune.parallel=2, the same slots as two hosts.

Wall time runs from the commands' start to the last one's exit (start-up included: the
temporary Prefect API, staging the study's data); trials per minute counts the study's
complete trials between its first trial's start and its last trial's end (from Optuna's
records). Ratios are baseline time / subject time per round (> 1: subject faster); the
median of the rounds is printed.

The hosts share this machine's cores, so two hosts can be no faster than two slots on one:
the figures show what the shared study costs (coordination through the database, a second
`enn tune`), not what a second machine gains.

    python -m bench.bench_tune_hosts [--rounds 5] [--trials 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

from bench.harness import machine_facts
from tasks.tuning.study import override
from tests.fixtures.hosts import Host, TestBed, missing_capability
from tests.fixtures.multihost import TEMPLATE
from tests.fixtures.postgres import Postgres
from tests.fixtures.postgres import missing as postgres_missing
from tests.fixtures.project import contained_env, make_project

SPACE = {"train.lr": {"low": 1e-4, "high": 0.03, "log": True}}
DUMP = """
import json, sys, optuna
study = optuna.load_study(study_name=sys.argv[2], storage=sys.argv[1])
print(json.dumps([
    [t.state.name, t.datetime_start.isoformat(), t.datetime_complete.isoformat()]
    for t in study.get_trials() if t.datetime_complete is not None
]))
"""
VARIANTS = ("one host", "two hosts", "one host, two slots")


def study_sets(name: str, storage: str, trials: int, parallel: int) -> list[str]:
    sets = [
        override("tune.study", name),
        override("tune.storage", storage),
        override("tune.space", SPACE),
        f"tune.n_trials={trials}",
        "tune.sampler=random",
        "tune.pruner=none",
        f"tune.parallel={parallel}",
        "train.epochs=2",
        "checkpoint.every_steps=0",
        "tracking.enabled=false",
    ]
    return [p for s in sets for p in ("--set", s)]


def run_study(
    hosts: list[Host], name: str, storage: str, trials: int, parallel: int, pg: Postgres, logs: Path
) -> dict:
    cmd = ["enn", "tune", *study_sets(name, storage, trials, parallel)]
    t0 = time.perf_counter()
    procs = [h.popen(*cmd, log=logs / f"{name}.log", env={**h.env, **pg.env}) for h in hosts]
    codes = [p.wait(timeout=3600) for p in procs]
    wall = time.perf_counter() - t0
    if any(codes):
        tail = (logs / f"{name}.log").read_text()[-3000:]
        raise SystemExit(f"{name}: enn tune exited {codes}:\n{tail}")
    env = {**hosts[0].env, **pg.env}
    rows = json.loads(hosts[0].run("python", "-c", DUMP, storage, name, env=env).stdout)
    done = [r for r in rows if r[0] == "COMPLETE"]
    start = min(datetime.fromisoformat(r[1]) for r in done)
    end = max(datetime.fromisoformat(r[2]) for r in done)
    span = (end - start).total_seconds()
    return {"wall_s": wall, "trials": len(done), "per_min": 60 * len(done) / span}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--trials", type=int, default=8)
    args = ap.parse_args(argv)
    why = missing_capability() or postgres_missing()
    if why:
        print(f"bench_tune_hosts: cannot run here: {why}", file=sys.stderr)
        return 2
    bed = TestBed.create()
    try:
        project = make_project(bed.view, None)
        project.set_params(TEMPLATE)
        node1, node2, node3 = bed.start(["node1", "node2", "node3"], env=contained_env(bed.view))
        pg = Postgres.start(node3, bed.base / "postgres", bed.port(5))
        pg.create_database("optuna")
        storage = pg.url("optuna")
        hosts = {
            VARIANTS[0]: ([node1], 1),
            VARIANTS[1]: ([node1, node2], 1),
            VARIANTS[2]: ([node1], 2),
        }
        results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
            for variant in order:
                who, parallel = hosts[variant]
                name = f"bench-{r}-{VARIANTS.index(variant)}"
                got = run_study(who, name, storage, args.trials, parallel, pg, bed.base)
                results[variant].append(got)
                print(
                    f"round {r}: {variant:20s} {got['wall_s']:6.1f} s, {got['trials']} trials, "
                    f"{got['per_min']:.2f} trials/min",
                    flush=True,
                )
        base = results[VARIANTS[0]]
        summary = {}
        for variant in VARIANTS:
            runs = results[variant]
            summary[variant] = {
                "wall_s_median": statistics.median(x["wall_s"] for x in runs),
                "trials_per_min_median": statistics.median(x["per_min"] for x in runs),
                "wall_ratio_vs_one_host": statistics.median(
                    b["wall_s"] / x["wall_s"] for b, x in zip(base, runs, strict=True)
                ),
                "rate_ratio_vs_one_host": statistics.median(
                    x["per_min"] / b["per_min"] for b, x in zip(base, runs, strict=True)
                ),
            }
        print(json.dumps({"trials": args.trials, "rounds": args.rounds, **summary}, indent=1))
        print(json.dumps(machine_facts()))
    finally:
        bed.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
