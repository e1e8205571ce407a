"""Doctor, distributed layer: the backend the runtime will use, the world size it resolves to
(with threads per worker), and the timeouts from the runtime config.

Fails when the configured device or backend is missing (runtime.device=cuda without CUDA,
more workers than GPUs); warns on settings that make a hang long or a run slow (a stuck
collective that waits the 30-minute gloo default, a task timeout shorter than the collective
timeout, fork in a threaded process, more threads than cores).
"""

from __future__ import annotations

from typing import TypedDict

import torch
import torch.distributed as dist

from enn_core.doctor.context import DoctorContext
from enn_core.doctor.report import Check, Recorder
from enn_core.runtime.device import threads_per_worker, usable_cores
from enn_core.train.stage import resolve_world_size

LONG_TIMEOUT_S = 1800.0  # gloo's default: a stuck collective is noticed after 30 minutes


class WorldFacts(TypedDict):
    """The measurements of the world size line (its report data)."""

    world_size: int
    threads: int
    cores: int


def run(ctx: DoctorContext) -> list[Check]:
    rec = Recorder("distributed")
    backend(ctx, rec)
    world(ctx, rec)
    timeouts(ctx, rec)
    return rec.checks


def backend(ctx: DoctorContext, rec: Recorder) -> None:
    if ctx.device_problem:
        rec.add(
            "backend",
            "fail",
            ctx.device_problem,
            "set runtime.device=auto (or cpu) on this machine",
        )
        return
    if not dist.is_available():
        rec.add(
            "backend",
            "fail",
            "torch.distributed is not available in this torch build",
            "install a torch build with distributed support",
        )
        return
    gloo = dist.is_gloo_available()
    if ctx.device.type == "cuda":
        nccl = dist.is_nccl_available()
        detail = (
            f"cuda:nccl (NCCL {'available' if nccl else 'MISSING'}) + cpu:gloo control lane "
            f"(gloo {'available' if gloo else 'MISSING'})"
        )
        if not (nccl and gloo):
            rec.add("backend", "fail", detail, "install a CUDA torch build with NCCL and gloo")
            return
        rec.add("backend", "ok", detail, backend="cuda:nccl,cpu:gloo")
        return
    if not gloo:
        rec.add(
            "backend",
            "fail",
            "gloo is not available in this torch build",
            "install a torch build with gloo",
        )
        return
    rec.add(
        "backend",
        "ok",
        "gloo on CPU (collectives, agreement flags and checkpoints)",
        backend="gloo",
    )


def world(ctx: DoctorContext, rec: Recorder) -> None:
    rt = ctx.cfg.runtime
    device = "cpu" if ctx.device.type == "cpu" else rt.device
    n, why = resolve_world_size(rt.world_size, device)
    threads = threads_per_worker(rt.threads_per_worker, n)
    cores = usable_cores()
    detail = (
        f"{n} worker(s) ({why}), {threads} thread(s) each on {cores} core(s); "
        f"start method {rt.start_method}; "
        f"max_restarts {rt.max_restarts}"
    )
    facts: WorldFacts = {"world_size": n, "threads": threads, "cores": cores}
    gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    if ctx.device.type == "cuda" and n > gpus:
        rec.add(
            "world size",
            "fail",
            f"{detail}; only {gpus} GPU(s)",
            f"set runtime.world_size <= {gpus} (0 = one per GPU)",
            **facts,
        )
    elif rt.start_method == "fork":
        rec.add(
            "world size",
            "warn",
            detail + "; fork is unsafe in a threaded process (Prefect runs tasks in threads)",
            "set runtime.start_method=spawn",
            **facts,
        )
    elif n * threads > cores:
        rec.add(
            "world size",
            "warn",
            f"{detail}: {n * threads} threads oversubscribe {cores} cores",
            f"set runtime.threads_per_worker=0 (auto: {max(1, cores // n)}) or fewer workers",
            **facts,
        )
    else:
        rec.add("world size", "ok", detail, **facts)


def timeouts(ctx: DoctorContext, rec: Recorder) -> None:
    rt = ctx.cfg.runtime
    detail = (
        f"process group {rt.pg_timeout_s:.0f} s during bootstrap and first step, "
        f"{rt.pg_timeout_steady_s:.0f} s after; hang watchdog {rt.hang_timeout_s:.0f} s; "
        f"stage {rt.task_timeout_s:.0f} s"
    )
    facts = {
        k: getattr(rt, k)
        for k in ("pg_timeout_s", "pg_timeout_steady_s", "hang_timeout_s", "task_timeout_s")
    }
    longest = max(rt.pg_timeout_s, rt.pg_timeout_steady_s, rt.hang_timeout_s)
    if rt.task_timeout_s <= longest:
        rec.add(
            "timeouts",
            "warn",
            f"{detail}: the stage times out before a stuck rank is named",
            f"set runtime.task_timeout_s above {longest:.0f} s, or lower the others",
            **facts,
        )
    elif max(rt.pg_timeout_s, rt.pg_timeout_steady_s) >= LONG_TIMEOUT_S:
        rec.add(
            "timeouts",
            "warn",
            f"{detail}: a stuck collective is noticed only after {longest / 60:.0f} minutes",
            "lower runtime.pg_timeout_s / pg_timeout_steady_s (e.g. 300 / 120)",
            **facts,
        )
    else:
        rec.add("timeouts", "ok", detail, **facts)
