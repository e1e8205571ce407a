"""Orchestration overhead per stage: what Prefect, DVC and MLflow add around each enn_core call.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_orchestration.py [--runs 5]

For each of `--runs` training flows (all seven stages, on the tests' tiny synthetic config in
a temp git + DVC copy of the project; each run changes `data.synthetic.seed`, so DVC re-runs
every stage), per stage:

    overhead = (the stage's wall time in the flow) - (the enn_core call, timed in the same run)
               - (model logging: the export's ONNX log + registration, timed in the same run)

The stage's wall time in the flow is the time from the end of the previous stage's Prefect task
run (the flow run's start for the first stage) to the end of its own, read back from Prefect's
API: it holds task creation and state changes, the DVC status check and commit, the run
directory, MLflow runs, artifacts and events, and the Prefect artifacts. The enn_core call is the
runner's `work_seconds`. Prints the median over the runs per stage (the aim: under 2 s after
the first stage) and machine facts. Not a test: it prints, it never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from enn_core.stages import TRAINING

STAGES = tuple(s.name for s in TRAINING)

ROOT = Path(__file__).resolve().parents[1]


# Where the overhead goes: (module, attribute, component, index of the stage argument).
# Wrapped for timing only: the real functions run.
TIMED = (
    ("tasks.dvc_state", "stage_status", "dvc status+commit", 1),
    ("tasks.dvc_state", "commit", "dvc status+commit", 1),
    ("tasks.prefect_task", "execute_stage", "runner", 0),
    ("tasks.tracking.runs:Tracker", "after_stage", "mlflow artifacts+plots", 1),
    ("tasks.prefect_task", "publish", "prefect artifacts", 0),
    ("tasks.prefect_task", "publish_diagnostics", "prefect artifacts", 0),
)


def _instrument(timings: dict) -> None:
    import importlib

    def wrap(owner, attr: str, component: str, at: int | str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = at if isinstance(at, str) else args[at]
                key = getattr(key, "name", getattr(key, "stage", key))  # a spec or a result
                per = timings.setdefault(str(key), {})
                per[component] = per.get(component, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)

    for module, attr, component, at in TIMED:
        name, _, cls = module.partition(":")
        owner = importlib.import_module(name)
        wrap(getattr(owner, cls) if cls else owner, attr, component, at)
    from tasks.tracking import models

    wrap(models, "register_export", "model logging", "export")


def child(runs: int) -> None:
    """Run in the temp project (cwd, PYTHONPATH): `runs` training flows, one JSON line each."""
    import asyncio

    from tasks.env import contain, project_layout

    contain(project_layout(Path.cwd(), "work"))  # as `enn` does, before prefect is imported
    from flows.training import training

    timings: dict[str, dict[str, float]] = {}
    _instrument(timings)
    for i in range(runs):
        timings.clear()
        t0 = time.perf_counter()
        state = training(
            config=str(Path.cwd() / "params.yaml"),
            overrides=[f"data.synthetic.seed={i + 1}"],
            return_state=True,
        )
        flow_s = time.perf_counter() - t0
        results = {k: {"work_seconds": r.work_seconds} for k, r in state.result().items()}
        ends = asyncio.run(_task_ends(state.state_details.flow_run_id))
        logged = timings.get("export", {}).get("model logging", 0.0)
        parts = {k: v for k, v in timings.items() if k in STAGES}
        print(
            json.dumps(
                {
                    "run": i,
                    "flow_s": flow_s,
                    "results": results,
                    "ends": ends,
                    "model_logging_s": logged,
                    "parts": parts,
                }
            ),
            flush=True,
        )


async def _task_ends(flow_run_id) -> dict:
    """The flow run's start and each task run's end (seconds since the epoch), from the API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    async with get_client() as client:
        run = await client.read_flow_run(flow_run_id)
        tasks = await client.read_task_runs(  # explicit limit and sort: the server refuses nulls
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            sort=TaskRunSort.EXPECTED_START_TIME_ASC,
            limit=100,
        )
    ends = {
        t.name.rsplit("-", 1)[0] if t.name not in STAGES else t.name: t.end_time.timestamp()
        for t in tasks
        if t.end_time
    }
    return {"flow_start": run.start_time.timestamp(), **ends}


def overheads(record: dict) -> dict[str, dict[str, float]]:
    """Per stage: the overhead (wall time in the flow minus the enn_core call, minus model
    logging for export) and where it went."""
    out, prev = {}, record["ends"]["flow_start"]
    for stage in STAGES:
        end = record["ends"][stage]
        wall, prev = end - prev, end
        parts = record["parts"].get(stage, {})
        logged = parts.get("model logging", 0.0)
        work = record["results"][stage]["work_seconds"]
        total = wall - work - logged
        runner = parts.get("runner", 0.0) - work - logged
        dvc, artifacts = parts.get("dvc status+commit", 0.0), parts.get("prefect artifacts", 0.0)
        out[stage] = {
            "overhead": total,
            "dvc": dvc,
            "runner": runner,
            "after_stage": parts.get("mlflow artifacts+plots", 0.0) - logged,
            "prefect artifacts": artifacts,
            "prefect task+flow": total - dvc - runner - artifacts,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.runs)
        return
    sys.path.insert(0, str(ROOT))
    from bench.harness import machine_facts
    from tests.fixtures.project import make_project

    with tempfile.TemporaryDirectory(prefix="bench-orch-") as tmp:
        project = make_project(Path(tmp) / "proj", Path(tmp) / "prefect-home")
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", "--runs", str(args.runs)],
            cwd=project.root,
            env=project.env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            sys.exit(
                f"the flows failed ({proc.returncode}):\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
            )
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"run"')]
    per_run = [overheads(r) for r in records]
    print(
        f"orchestration overhead per stage, seconds (median of {len(records)} training flows; "
        "the aim: < 2 s after the first stage)"
    )
    parts = ("dvc", "runner", "after_stage", "prefect artifacts", "prefect task+flow")
    print(
        f"{'stage':20s} {'median':>7s} {'min':>7s} {'max':>7s} {'enn_core':>8s}   where (medians): "
        + ", ".join(parts)
    )
    for stage in STAGES:
        vals = [o[stage]["overhead"] for o in per_run]
        work = statistics.median(r["results"][stage]["work_seconds"] for r in records)
        where = "  ".join(f"{statistics.median(o[stage][k] for o in per_run):6.2f}" for k in parts)
        print(
            f"{stage:20s} {statistics.median(vals):7.2f} {min(vals):7.2f} {max(vals):7.2f} "
            f"{work:8.2f}   {where}"
        )
    print(
        "runner: the stage runner's time beyond the enn_core call (run directory, MLflow child "
        "run, params, events, diagnostics, artifacts); after_stage: its MLflow artifacts and PNG "
        "plots part"
    )
    print(
        f"export model logging (excluded above): median "
        f"{statistics.median(r['model_logging_s'] for r in records):.2f} s"
    )
    print(f"whole flow: median {statistics.median(r['flow_s'] for r in records):.1f} s")
    print(
        json.dumps(
            {
                "machine": machine_facts(),
                "load_avg": os.getloadavg(),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            }
        )
    )


if __name__ == "__main__":
    main()
