"""One prediction worker's work: its own contiguous block of parts, each with the whole model.

`predict_parts(job)` computes the parts of `job.rank` that are not complete yet. With one
worker it runs in the stage's process (`run`, no start-up cost); several workers are the ranks
of a job the project's launcher starts (enn_core.predict.ranks), on one node or several.

The predictor is whatever `job.loader()` returns: a callable from a float32 `[B, F]` tensor of
raw features to `[B, *out_shape]` predictions in real units (normally the collapse-check's
chosen `PredictionPath` over the consolidated checkpoint, see `enn_core.predict.model_io`).
A job that travels to launched workers names its loader as a `Loader` record (a module-level
function and JSON arguments); in the stage's own process any callable does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

import numpy as np
import torch

from enn_core.config import FaultConfig
from enn_core.fault import FaultInjector
from enn_core.predict.chunks import PartsPlan, PartStore, parts_key, parts_of_worker
from enn_core.progress import Ticker, bar, shows
from enn_core.runtime.entry import resolve
from enn_core.runtime.heartbeat import Heartbeat
from enn_core.stages.predict import PREDICT

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
class Loader:
    """A predictor's loader that travels as JSON: `module:function` and its arguments."""

    entry: str
    args: tuple[Any, ...] = ()

    def __call__(self) -> Predictor:
        return resolve(self.entry)(*self.args)


@dataclass(frozen=True)
class WorkerJob:
    """Everything one worker needs; plain data (JSON for launched workers: `as_record`)."""

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
    progress_every_s: float = 60.0  # rank 0's progress line where no bar shows
    secret_file: str = ""  # the job secret keying the parts' markers (chunks.parts_key)

    def as_record(self) -> dict[str, Any]:
        if not isinstance(self.loader, Loader):
            raise TypeError(f"a launched worker's loader must be a Loader record: {self.loader!r}")
        rec = asdict(self)
        rec["loader"] = {"entry": self.loader.entry, "args": list(self.loader.args)}
        return rec

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> WorkerJob:
        plan = {**rec["plan"], "out_shape": tuple(rec["plan"]["out_shape"])}
        loader = Loader(rec["loader"]["entry"], tuple(rec["loader"]["args"]))
        return cls(
            **{
                **rec,
                "plan": PartsPlan(**plan),
                "loader": loader,
                "fault": FaultConfig(**rec["fault"]),
            }
        )


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
    store = PartStore(job.parts_dir, job.plan, parts_key(job.secret_file))
    faults = FaultInjector(job.fault, rank=job.rank, marker_dir=job.fault_marker_dir or None)
    features = np.load(job.features_path, mmap_mode="r")
    index = np.load(job.index_path, mmap_mode="r") if job.index_path else None
    device = torch.device(job.device)
    computed: list[int] = []
    reused: list[int] = []
    rows = 0
    t_loop = time.perf_counter()
    mine = parts_of_worker(job.plan.n_parts, job.rank, job.world_size)
    tick = Ticker(
        PREDICT.name,
        sum(job.plan.part_range(k)[1] - job.plan.part_range(k)[0] for k in mine),
        every_s=job.progress_every_s,
        logger=logging.getLogger("enn.predict"),
        quiet=job.rank != 0 or shows(),
    )
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
            tick.update(stop - start)
            faults.at("predict_chunk", step=k)
    return {
        "rank": job.rank,
        "computed_parts": computed,
        "reused_parts": reused,
        "rows_computed": rows,
        "seconds_total": time.perf_counter() - t0,
        "seconds_predict": time.perf_counter() - t_loop,
    }


def run(jobs: list[WorkerJob], predictor: Predictor | None = None) -> list[WorkerStats]:
    """One job in this process (reusing `predictor` if given). Several workers are the ranks
    of a launched job (enn_core.predict.ranks.launch_ranks), whatever the node count."""
    if len(jobs) != 1:
        raise ValueError("predict.workers.run runs one job; launch several with predict.ranks")
    return [predict_parts(jobs[0], predictor)]
