"""The worker entry of every job enn launches: each process torchrun starts runs this.

    python -m enn_core.runtime.entry <run_dir>/launch/job.json

The job file (written by enn_core.runtime.launch) names a function `module:function`, its
JSON arguments and the run directory. The worker dies with its parent (torchrun, or enn for
a one-worker job), calls the function, and writes its result as JSON to
`<run_dir>/results/rank-<r>.json`; a function that raises leaves
`<run_dir>/errors/rank-<r>.json` (its own, or one written here) and exits 1. The functions:
distributed-train's worker (`enn_core.train.worker:main`), prediction's ranks
(`enn_core.predict.ranks:rank_main`), the doctor's all-reduce, and tests' plain functions.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from enn_core.atomic import write_json
from enn_core.runtime.parent import die_with_parent, exit_process
from enn_core.runtime.watchdog import ERRORS, write_error

RESULTS = "results"


def resolve(entry: str) -> Callable[..., Any]:
    """`module:function` (a dotted attribute path after the colon)."""
    module, _, name = entry.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def result_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / RESULTS / f"rank-{rank}.json"


def read_results(run_dir: Path) -> dict[int, Any]:
    """{global rank: value} of every rank of this run directory that finished."""
    out: dict[int, Any] = {}
    for p in sorted((Path(run_dir) / RESULTS).glob("rank-*.json")):
        rec = json.loads(p.read_text())
        out[int(rec["rank"])] = rec["value"]
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent()
    job = json.loads(Path(argv[0]).read_text())
    run_dir, rank = Path(job["run_dir"]), int(os.environ.get("RANK", "0"))
    t0 = time.time()
    try:
        value = resolve(job["entry"])(*job["args"])
    except BaseException as e:
        own = Path(run_dir) / ERRORS / f"rank-{rank}.json"
        if not (own.exists() and own.stat().st_mtime >= t0 - 1):  # the function wrote none
            write_error(run_dir, rank, e, "entry", None, traceback.format_exc())
        traceback.print_exc()
        return 1
    write_json(result_path(run_dir, rank), {"rank": rank, "value": value})
    return 0


if __name__ == "__main__":
    exit_process(main())
