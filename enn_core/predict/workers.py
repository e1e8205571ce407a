"""Prediction workers: N plain processes, each with the whole model, each predicting its own
contiguous block of parts. No process group, no collectives: prediction needs none.

`run_workers(jobs)` starts one spawned process per job (the `spawn` start method: safe in the
threaded processes Prefect runs tasks in) and waits. The workers die with the caller: each
asks the kernel for SIGKILL when its parent dies (Linux `PR_SET_PDEATHSIG`) and also watches
its parent's pid, and the caller kills the others as soon as one fails, or when it is itself
interrupted. With one worker, `predict_parts` runs in the caller's process (no start-up cost).

The predictor is whatever `job.loader()` returns: a callable from a float32 `[B, F]` tensor of
raw features to `[B, *out_shape]` predictions in real units (normally the collapse-check's
chosen `PredictionPath` over the consolidated checkpoint, see `enn_core.predict.model_io`).
`loader` must be picklable (a module-level function or a `functools.partial` of one).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TypedDict

import numpy as np
import torch

from enn_core.config import FaultConfig
from enn_core.errors import EnnError, WorkerError
from enn_core.fault import FaultInjector
from enn_core.predict.chunks import PartsPlan, PartStore, parts_of_worker
from enn_core.progress import bar
from enn_core.runtime.heartbeat import Heartbeat, read_heartbeats, stack_path

Predictor = Callable[[torch.Tensor], torch.Tensor]


class WorkerStats(TypedDict, total=False):
    """One worker's record (`worker-<rank>.json`): its counts and timings, or its error; empty
    when a spawned worker left no readable record."""

    rank: int
    computed_parts: list[int]
    reused_parts: list[int]
    rows_computed: int
    seconds_total: float
    seconds_predict: float
    error: str


@dataclass(frozen=True)
class WorkerJob:
    """Everything one worker needs; plain data, pickled to the spawned process."""

    rank: int
    world_size: int
    parts_dir: str
    plan: PartsPlan
    features_path: str
    index_path: str | None  # int64 dataset row of each predicted row; None = all rows in order
    batch_size: int
    loader: Callable[[], Predictor]
    device: str = "cpu"
    threads: int = 1
    fault: FaultConfig = field(default_factory=FaultConfig)
    fault_marker_dir: str = ""
    hang_timeout_s: float = 0.0  # spawned workers: no progress for this long = hung (0 = off)


def read_batch(features: np.ndarray, index: np.ndarray | None, b0: int, b1: int) -> torch.Tensor:
    """Rows [b0, b1) of the predicted row list as a float32 tensor (one block read)."""
    block = features[b0:b1] if index is None else features[np.asarray(index[b0:b1])]
    arr = np.asarray(block, dtype=np.float32)
    if not (arr.flags.writeable and arr.flags.c_contiguous):  # a read-only memmap slice
        arr = np.array(arr, order="C")
    return torch.from_numpy(arr)


def predict_parts(
    job: WorkerJob, predictor: Predictor | None = None, beat: Heartbeat | None = None
) -> WorkerStats:
    """Compute this worker's parts that are not already complete; returns counts and timings."""
    t0 = time.perf_counter()
    if beat is not None:
        beat.phase("load_model")
    predictor = predictor if predictor is not None else job.loader()
    store = PartStore(job.parts_dir, job.plan)
    faults = FaultInjector(job.fault, rank=job.rank, marker_dir=job.fault_marker_dir or None)
    features = np.load(job.features_path, mmap_mode="r")
    index = np.load(job.index_path, mmap_mode="r") if job.index_path else None
    device = torch.device(job.device)
    computed: list[int] = []
    reused: list[int] = []
    rows = 0
    t_loop = time.perf_counter()
    mine = parts_of_worker(job.plan.n_parts, job.rank, job.world_size)
    with (
        torch.inference_mode(),
        bar(len(mine), f"predict rank {job.rank}", job.rank == 0, "part") as pbar,
    ):
        for k in mine:
            pbar.update(1)
            if store.is_done(k):
                reused.append(k)
                continue
            start, stop = job.plan.part_range(k)
            if beat is not None:
                beat.phase("predict_part", k)
            with store.writing(k, rank=job.rank) as buf:
                for b0 in range(start, stop, job.batch_size):
                    if beat is not None:
                        beat.progress()
                    b1 = min(b0 + job.batch_size, stop)
                    y = predictor(read_batch(features, index, b0, b1).to(device, non_blocking=True))
                    buf[b0 - start : b1 - start] = y.detach().to("cpu").numpy()
            computed.append(k)
            rows += stop - start
            faults.at("predict_chunk", step=k)
    return {
        "rank": job.rank,
        "computed_parts": computed,
        "reused_parts": reused,
        "rows_computed": rows,
        "seconds_total": time.perf_counter() - t0,
        "seconds_predict": time.perf_counter() - t_loop,
    }


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the parent dies (kernel-side on Linux, plus a pid watch)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _worker_main(job: WorkerJob, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    torch.set_num_threads(max(1, job.threads))
    status = Path(job.parts_dir) / f"worker-{job.rank}.json"
    beat = Heartbeat(job.parts_dir, job.rank).start()
    try:
        stats = predict_parts(job, beat=beat)
        beat.stop()
    except BaseException as e:  # report any failure to the parent in one line, then exit 1
        msg = str(e).splitlines()[0] if str(e) else ""
        status.write_text(json.dumps({"rank": job.rank, "error": f"{type(e).__name__}: {msg}"}))
        sys.exit(1)
    status.write_text(json.dumps(stats))


def _status(parts_dir: str, rank: int) -> WorkerStats:
    path = Path(parts_dir) / f"worker-{rank}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def run_workers(
    jobs: list[WorkerJob], *, poll_s: float = 0.05, cancel: threading.Event | None = None
) -> list[WorkerStats]:
    """Run the jobs in spawned processes; all of them, or an error naming the failed rank.
    `cancel` set (the run was cancelled) kills every worker and raises WorkerError."""
    ctx = mp.get_context("spawn")
    for job in jobs:
        (Path(job.parts_dir) / f"worker-{job.rank}.json").unlink(missing_ok=True)
    procs = [
        ctx.Process(target=_worker_main, args=(j, os.getpid()), name=f"predict-{j.rank}")
        for j in jobs
    ]
    try:
        for p in procs:
            p.start()
        while any(p.exitcode is None for p in procs):
            for job, p in zip(jobs, procs, strict=True):
                if p.exitcode not in (None, 0):
                    raise _failure(job, p.exitcode)
            _check_hang(jobs, procs)
            if cancel is not None and cancel.is_set():
                raise WorkerError(
                    f"predict cancelled; its {len(procs)} workers were killed, completed parts in "
                    f"{jobs[0].parts_dir} are kept: re-run predict to resume"
                )
            time.sleep(poll_s)
        for job, p in zip(jobs, procs, strict=True):
            if p.exitcode not in (None, 0):  # every worker has exited here
                raise _failure(job, p.exitcode)
    finally:
        for p in procs:
            if p.exitcode is None and p.pid is not None:
                p.kill()
            p.join(timeout=10)
    return [_status(j.parts_dir, j.rank) for j in jobs]


def _check_hang(jobs: list[WorkerJob], procs: Sequence[BaseProcess]) -> None:
    """A worker whose heartbeat shows no progress for hang_timeout_s is hung: dump its stack,
    fail."""
    timeout = jobs[0].hang_timeout_s
    if timeout <= 0:
        return
    beats = read_heartbeats(Path(jobs[0].parts_dir))
    now = time.time()
    for job, p in zip(jobs, procs, strict=True):
        b = beats.get(job.rank)
        if b is None or p.exitcode is not None or now - float(b["progress_time"]) <= timeout:
            continue
        if p.pid is None:  # not started (run_workers starts every worker first): not hung
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGUSR1)  # faulthandler writes every thread's stack
        time.sleep(1.0)
        where = f"phase {b.get('phase')} step {b.get('step')} at {b.get('frame')}"
        raise WorkerError(
            f"predict worker rank {job.rank}/{job.world_size} made no progress for "
            f"{now - b['progress_time']:.0f} s (runtime.hang_timeout_s={timeout:g}; {where}); "
            f"stacks in {stack_path(Path(job.parts_dir), job.rank)}; "
            "completed parts are kept: re-run predict to resume"
        )


def _failure(job: WorkerJob, code: int) -> EnnError:
    why = _status(job.parts_dir, job.rank).get("error") or (
        f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    )
    return WorkerError(
        f"predict worker rank {job.rank}/{job.world_size} failed ({why}); completed parts in "
        f"{job.parts_dir} are kept: re-run predict to resume"
    )


def run(
    jobs: list[WorkerJob], predictor: Predictor | None = None, cancel: threading.Event | None = None
) -> list[WorkerStats]:
    """One job: in this process (reusing `predictor` if given). Several: spawned workers,
    killed when `cancel` (the stage's `ctx.cancel`) is set."""
    if len(jobs) == 1:
        return [predict_parts(jobs[0], predictor)]
    return run_workers(jobs, cancel=cancel)
