"""Doctor, workers layer: start real workers through the project's launcher (torchrun in a
child process, enn_core.runtime.launch) and all-reduce across them within a timeout.

As many workers as the device allows: one per GPU on CUDA, at least two on CPU (so a
collective actually crosses processes). Each worker bootstraps like a training worker
(threads, process group on a per-attempt PrefixStore, device mesh), announces its phases on
a heartbeat, and all-reduces its rank + 1 on the CPU (gloo) lane and, on CUDA, on the NCCL
lane. The timeout is runtime.pg_timeout_steady_s capped at MAX_TIMEOUT_S: a rank that never
arrives makes the check fail within it, naming that rank and its phase (the launcher's
watchdog or its collective-timeout analysis). Run records of a failed check are kept.

The `fault` config section reaches the workers: phase `doctor_allreduce` (with rank and
kind hang) is how the tests block one rank.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch

from enn_core.config import RunConfig, to_plain
from enn_core.doctor.context import DoctorContext
from enn_core.doctor.report import Check, Recorder
from enn_core.errors import EnnError, WorkerError
from enn_core.runtime.device import usable_cores

if TYPE_CHECKING:
    from enn_core.runtime.dist import DistEnv

MAX_TIMEOUT_S = 60.0
PHASE = "doctor_allreduce"


class ReduceResult(TypedDict):
    """One worker's all-reduce: the sum it got (NaN when the lanes disagree), lanes, time."""

    rank: int
    sum: float
    lanes: list[str]
    reduce_s: float


def worker_count(ctx: DoctorContext) -> tuple[int, str]:
    if ctx.device.type == "cuda":
        n = torch.cuda.device_count()
        return n, f"one per GPU ({n})"
    n = max(2, min(ctx.cfg.runtime.world_size or 2, usable_cores()))
    return n, f"{n} on CPU (at least two, so the all-reduce crosses processes)"


def run(ctx: DoctorContext) -> list[Check]:
    rec = Recorder("workers")
    n, why = worker_count(ctx)
    timeout = min(ctx.cfg.runtime.pg_timeout_steady_s, MAX_TIMEOUT_S)
    try:
        run_dir = Path(tempfile.mkdtemp(prefix="enn-doctor-workers-", dir=_run_parent(ctx)))
    except OSError as e:
        rec.add(
            "all-reduce",
            "fail",
            f"no directory for the workers' run records ({e.strerror or e})",
            "make runtime.work_dir or TMPDIR writable (see the data layer's fs lines)",
        )
        return rec.checks
    with rec.timer() as t:
        try:
            results = start_and_reduce(ctx.cfg, ctx.device.type, n, run_dir, timeout)
        except (EnnError, OSError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            rec.add(
                "all-reduce",
                "fail",
                f"{n} workers, timeout {timeout:.0f} s: {msg}",
                _fix(msg, run_dir),
                t(),
                run_dir=str(run_dir),
                workers=n,
            )
            return rec.checks
        secs = t()
    shutil.rmtree(run_dir, ignore_errors=True)
    want = n * (n + 1) / 2
    wrong = {r: v["sum"] for r, v in results.items() if v["sum"] != want}
    lanes = results[0]["lanes"]
    reduce_ms = max(v["reduce_s"] for v in results.values()) * 1e3
    detail = (
        f"{n} workers ({why}) started through torchrun; "
        f"all-reduce on {'+'.join(lanes)} in {reduce_ms:.0f} ms; "
        f"{secs:.1f} s in all (timeout {timeout:.0f} s)"
    )
    if wrong:
        rec.add(
            "all-reduce",
            "fail",
            f"{detail}; wrong sums {wrong} (expected {want})",
            "the collective backend returned wrong results: "
            "check the torch build and network interface",
            secs,
        )
    else:
        rec.add(
            "all-reduce", "ok", detail, seconds=secs, workers=n, lanes=lanes, reduce_ms=reduce_ms
        )
    return rec.checks


def _run_parent(ctx: DoctorContext) -> str | None:
    """Run records under the work directory when it can be written, else the temp dir."""
    parent = ctx.layout.work / "doctor"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return str(parent) if os.access(parent, os.W_OK) else None
    except OSError:
        return None


def _fix(msg: str, run_dir: Path) -> str:
    if "hung in phase" in msg or "waiting for it" in msg:
        return (
            "that rank never reached the all-reduce: "
            f"read its stack in {run_dir / 'stacks'} and its log in "
            f"{run_dir / 'logs'}; raise runtime.pg_timeout_steady_s only if it was merely slow"
        )
    return (
        f"see the per-rank logs in {run_dir / 'logs'}; check that loopback TCP ports can be opened"
    )


def start_and_reduce(
    cfg: RunConfig, device: str, n: int, run_dir: Path, timeout_s: float
) -> dict[int, ReduceResult]:
    """Launch `n` workers that all-reduce once; {rank: result}. Raises WorkerError naming a rank."""
    from enn_core.runtime.launch import launch

    spec = run_dir / "doctor-job.json"
    spec.write_text(
        json.dumps(
            {
                "config": to_plain(cfg),
                "run_dir": str(run_dir),
                "device": device,
                "timeout_s": timeout_s,
                "marker_dir": str(run_dir),
            },
            default=str,
        )
    )
    spawn = cfg.runtime.spawn_budget_s  # importing torch in N fresh processes on a loaded machine
    results = launch(
        worker,
        (str(spec),),
        nprocs=n,
        run_dir=run_dir,
        hang_timeout_s=timeout_s,
        budgets={"spawn": spawn, "bootstrap": spawn, "process_group": spawn},
        timeout_s=2 * spawn + 3 * timeout_s,
    )
    if sorted(results) != list(range(n)):
        raise WorkerError(f"expected results from ranks 0..{n - 1}, got {sorted(results)}")
    return results


def worker(spec_path: str) -> ReduceResult:
    """One worker: bootstrap, heartbeat, all-reduce rank+1 on each lane; errors recorded."""
    from enn_core.config.loader import build
    from enn_core.fault import FaultInjector
    from enn_core.runtime.dist import bootstrap, shutdown
    from enn_core.runtime.heartbeat import Heartbeat
    from enn_core.runtime.watchdog import write_error

    spec = json.loads(Path(spec_path).read_text())
    cfg: RunConfig = build(RunConfig, spec["config"], root=RunConfig, where=spec_path)
    run_dir, rank = Path(spec["run_dir"]), int(os.environ.get("RANK", "0"))
    hb = Heartbeat(
        run_dir, rank, attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ).start()
    try:
        hb.phase("process_group")
        env = bootstrap(
            device=spec["device"],
            threads=1,
            seed=cfg.runtime.seed,
            deterministic=False,
            pg_timeout_s=spec["timeout_s"],
        )
        hb.phase(PHASE)
        FaultInjector(cfg.fault, rank=rank, marker_dir=spec["marker_dir"]).at(PHASE)
        out = _reduce(env)
        hb.stop("done")
        return out
    except BaseException as e:
        write_error(run_dir, rank, e, *hb.where(), traceback.format_exc())
        raise
    finally:
        shutdown()


def _reduce(env: DistEnv) -> ReduceResult:
    import torch.distributed as dist

    t0 = time.perf_counter()
    cpu = torch.tensor([float(env.rank + 1)], dtype=torch.float64)
    dist.all_reduce(cpu)
    lanes, total = ["gloo"], float(cpu.item())
    if env.device.type == "cuda":
        gpu = torch.tensor([float(env.rank + 1)], device=env.device)
        dist.all_reduce(gpu)
        torch.cuda.synchronize(env.device)
        lanes.append("nccl")
        if float(gpu.item()) != total:
            total = float("nan")
    return {"rank": env.rank, "sum": total, "lanes": lanes, "reduce_s": time.perf_counter() - t0}
