"""Prediction as the ranks of a launched job: several workers, on one node or several (or under
an external launcher), share one parts folder.

    launch_ranks(spec, nprocs, ...)   # the stage, on every node: the project's launcher
    rank_main(spec_path)              # each rank; under an external launcher: this process

Each rank learns its place from the launcher (RANK, WORLD_SIZE), computes its contiguous
block of the plan's parts (enn_core.predict.chunks.parts_of_worker, the same parts whoever
computes them) into the shared parts folder, and waits at one barrier until every rank has
written its share; the stage on global rank 0's node then assembles them. A rank that dies
ends the barrier for the others at once (gloo sees its connections close); completed parts
stay, so running the stage again on every node computes only the missing ones.

The process group carries nothing but that barrier and a check at the start that every rank
predicts the same plan (model and input fingerprints, rows per part): a node with another
model or other staged data would otherwise write parts the others then mix in.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import traceback
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist

from enn_core.atomic import write_json
from enn_core.errors import ConfigError, OutOfMemory, WorkerError
from enn_core.predict.chunks import PartsPlan, PartStore, parts_key
from enn_core.predict.workers import WorkerJob, WorkerStats, predict_parts
from enn_core.runtime.dist import (
    DistEnv,
    bootstrap,
    gather_objects,
    shutdown,
    tighten_timeout,
)
from enn_core.runtime.heartbeat import Heartbeat
from enn_core.runtime.launch import Rendezvous, launch
from enn_core.runtime.network import InterfaceChoice
from enn_core.runtime.watchdog import write_error

BARRIER = "barrier"  # the heartbeat phase of the final wait (the launcher gives it its own budget)


@dataclasses.dataclass(frozen=True)
class RankJob:
    """What every rank of a multi-node prediction gets: the job (its rank filled in by each
    rank), where its heartbeat goes, and how long the final barrier may wait."""

    job: WorkerJob
    run_dir: str  # this node's run directory: heartbeats, error records
    interface: InterfaceChoice
    barrier_timeout_s: float
    device: str  # runtime.device
    job_id: str = ""  # the run id, recorded in the parts folder enn makes

    def write(self, path: Path) -> Path:
        rec = {**dataclasses.asdict(self), "job": self.job.as_record()}
        write_json(path, rec)
        return path

    @classmethod
    def read(cls, path: str | Path) -> RankJob:
        rec: dict[str, Any] = json.loads(Path(path).read_text())
        return cls(
            **{
                **rec,
                "job": WorkerJob.from_record(rec["job"]),
                "interface": InterfaceChoice(**rec["interface"]),
            }
        )


@dataclasses.dataclass(frozen=True)
class Limits:
    """How the launcher watches the ranks (runtime.*): no progress for `hang_timeout_s` outside
    the final barrier is a hang; `spawn_s` to the first heartbeat; `timeout_s` in all."""

    hang_timeout_s: float
    spawn_s: float
    timeout_s: float
    max_restarts: int = 0


def launch_ranks(
    spec: RankJob,
    nprocs: int,
    limits: Limits,
    *,
    cancel: threading.Event | None = None,
    rdzv: Rendezvous | None = None,
) -> dict[int, WorkerStats]:
    """This node's `nprocs` ranks through the project's launcher; {global rank: stats}. A
    failure, a hang or a cancel is one WorkerError that says the completed parts are kept."""
    path = spec.write(Path(spec.run_dir) / "predict-job.json")
    kept = f"completed parts in {spec.job.parts_dir} are kept: re-run predict to resume"
    try:
        return launch(
            rank_main,
            (str(path),),
            nprocs=nprocs,
            run_dir=spec.run_dir,
            hang_timeout_s=limits.hang_timeout_s,
            budgets={"spawn": limits.spawn_s, BARRIER: limits.timeout_s},
            max_restarts=limits.max_restarts,
            timeout_s=limits.timeout_s,
            cancel=cancel,
            rdzv=rdzv,
        )
    except (WorkerError, OutOfMemory) as e:
        if cancel is not None and cancel.is_set():
            raise WorkerError(
                f"predict cancelled; its {nprocs} workers were killed, {kept}"
            ) from None
        said = "are kept" in str(e)  # a rank's own error that already says so
        raise type(e)(str(e) if said else f"{e}; {kept}") from None


def rank_main(spec_path: str) -> WorkerStats:
    """One rank: bootstrap, agree on the plan, predict this rank's parts, wait for all."""
    spec = RankJob.read(spec_path)
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    beat = Heartbeat(spec.run_dir, rank, attempt=attempt).start()
    try:
        beat.phase("process_group")
        env = bootstrap(
            device=spec.device,
            threads=spec.job.threads,
            seed=0,
            deterministic=False,
            pg_timeout_s=spec.barrier_timeout_s,
            interface=spec.interface,
        )
        job = dataclasses.replace(spec.job, rank=env.rank, world_size=env.world_size)
        check_same_plan(job.plan, env)
        # global rank 0 alone prepares the shared folder, once every rank has the same plan
        store = PartStore(job.parts_dir, job.plan, parts_key(job.secret_file))
        discarded = store.prepare(spec.job_id) if env.rank == 0 else None
        dist.barrier()
        stats = predict_parts(job, beat=beat)
        if discarded:  # the stage on this node reports it
            stats = cast(WorkerStats, {**stats, "discarded": discarded})
        beat.phase(BARRIER)
        tighten_timeout(spec.barrier_timeout_s)  # the others may still be predicting
        wait_for_the_others(job)
        beat.stop("done")
        return stats
    except BaseException as e:
        write_error(Path(spec.run_dir), rank, e, *beat.where(), traceback.format_exc())
        raise
    finally:
        shutdown()


def wait_for_the_others(job: WorkerJob) -> None:
    """The barrier after this rank's parts; a peer that died (its connections closed) or never
    came is one line that says what is kept and how to go on."""
    try:
        dist.barrier()
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        peer = re.search(r"peer \[?([^\]\s]+)\]?:\d+", first)
        # under TORCH_DISTRIBUTED_DEBUG=DETAIL the barrier is gloo's monitored one, whose text
        # names the missing ranks beside its (unreached) timeout: name the ranks only
        missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", first)
        if peer:
            who, how = f"the rank at {peer.group(1)}", "connection closed"
        elif missing:
            who, how = f"rank {missing.group(1).strip()}", "its connection closed"
        else:
            who, how = "another rank", first[:120]
        raise WorkerError(
            f"rank {job.rank} wrote its parts and waited for the other ranks, but {who} went "
            f"away ({how}): its node's prediction failed "
            f"or was killed; the completed parts in {job.parts_dir} are kept: run predict again "
            "on every node to compute only the missing ones"
        ) from None


def check_same_plan(plan: PartsPlan, env: DistEnv) -> None:
    """Every rank predicts with the same model, input and part size, or none starts."""
    host = os.uname().nodename
    plans = gather_objects([host, plan.to_manifest()], env)
    (first, mine) = plans[0]
    for r, (where, theirs) in enumerate(plans):
        if theirs != mine:
            diff = [k for k in mine if theirs.get(k) != mine[k]]
            raise ConfigError(
                f"rank {r} (on {where}) predicts another plan than rank 0 (on {first}): "
                f"{', '.join(diff)} differ; every node needs the same model, staged input and "
                "predict settings (dvc pull the same commit)"
            )
