"""The worker entry of every job enn launches: each process torchrun starts runs this.

    python -m enn_core.runtime.entry <run_dir>/launch/job.json

    python -m enn_core.runtime.entry --warm <module>     (a spare: enn_core.runtime.launch)

The job file (written by enn_core.runtime.launch) names a function `module:function`, its
JSON arguments and the run directory. A spare imports `<module>` first, then waits for its
job on standard input (one JSON line: the job file, the log file its output goes to, and the
variables of its rank); an end of input before one means it was not needed. The worker
dies with its parent (torchrun, or enn for a one-worker job), calls the function, and
writes its result as JSON to `<run_dir>/results/rank-<r>.json`; a function that raises leaves
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

from enn_core.atomic import open_own, write_json
from enn_core.runtime.parent import die_with_parent, exit_process
from enn_core.runtime.watchdog import ERRORS, write_error

RESULTS = "results"
WARM = "--warm"


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
    failed: Exception | None = None
    if argv[0] == WARM:
        taken, failed = wait_for_job(argv[1:])
        if taken is None:
            return 0
        argv = [taken]
    job = json.loads(Path(argv[0]).read_text())
    run_dir, rank = Path(job["run_dir"]), int(os.environ.get("RANK", "0"))
    t0 = time.time()
    try:
        if failed is not None:  # the spare's import: the job's error, as a fresh worker's
            raise failed
        value = resolve(job["entry"])(*job["args"])
    except BaseException as e:
        own = Path(run_dir) / ERRORS / f"rank-{rank}.json"
        if not (own.exists() and own.stat().st_mtime >= t0 - 1):  # the function wrote none
            write_error(run_dir, rank, e, "entry", None, traceback.format_exc())
        traceback.print_exc()
        return 1
    write_json(result_path(run_dir, rank), {"rank": rank, "value": value})
    return 0


def wait_for_job(modules: list[str]) -> tuple[str | None, Exception | None]:
    """A spare's start: `modules` imported, then its job from standard input (None when the
    input ends first) and what the imports raised; its output goes to the job's log from
    then on, its environment is the job's."""
    failed: Exception | None = None
    try:
        for module in modules:
            importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - raised again as the job's error, in its log
        failed = e
    line = sys.stdin.readline()
    if not line.strip():
        return None, failed
    handed = json.loads(line)
    for key in handed.get("unset", []):
        os.environ.pop(str(key), None)
    os.environ.update({str(k): str(v) for k, v in handed["env"].items()})
    log = open_own(handed["log"], mode=0o644)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return str(handed["job"]), failed


if __name__ == "__main__":
    exit_process(main())
