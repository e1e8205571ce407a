"""Runtime: where and how workers run. Excluded from checkpoint fingerprints."""

from __future__ import annotations

import re
from typing import Literal

from enn_core.config.fields import frozen
from enn_core.errors import ConfigError

RDZV_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]{0,199}$")  # as enn_core.paths.RUN_ID


def check_rendezvous(nnodes: int, endpoint: str, rdzv_id: str, *, external: bool = False) -> None:
    """A node count of at least 1; several nodes need a shared endpoint (host:port) and id,
    unless an external launcher (torchrun) ran the rendezvous already."""
    if nnodes < 1:
        raise ConfigError(f"runtime.nnodes={nnodes} must be >= 1")
    if nnodes > 1 and not external and not (endpoint and rdzv_id):
        raise ConfigError(
            f"runtime.nnodes={nnodes} needs runtime.rdzv_endpoint (host:port of one node) "
            "and runtime.rdzv_id (a job id), the same on every node"
        )
    if rdzv_id and (not RDZV_ID.match(rdzv_id) or ".." in rdzv_id):
        raise ConfigError(
            f"runtime.rdzv_id={rdzv_id[:80]!r} is not a name (letters, digits, '_', '.', '-', "
            "'@', '+'; no '..'; it names run folders): use e.g. job-2024-05-01"
        )
    host, _, port = endpoint.rpartition(":")
    if endpoint and (not host or not port.isdigit() or not 0 < int(port) < 65536):
        raise ConfigError(
            f"runtime.rdzv_endpoint={endpoint!r} is not host:port; use e.g. node0.example:29400"
        )


@frozen
class RuntimeConfig:
    work_dir: str = "work"
    """Work directory (relative to the project root): Prefect home, MLflow store, run dirs, DVC site
    cache, train checkpoints. Git- and DVC-ignored."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device for training and prediction; auto picks cuda when available."""

    world_size: int = 0
    """Number of worker processes; 0 means the number of GPUs, or 1 on CPU."""

    threads_per_worker: int = 0
    """torch threads in each worker; 0 means cores // world_size (at least 1)."""

    worker_memory_limit_mb: int = 0
    """Limit on each training worker's resident anonymous memory (RssAnon), in MiB; 0 = none. A
    worker past it ends at once with one out-of-memory line (exit code 13) naming what it held
    and what to change (more workers: FSDP2 shards the model; a smaller train.micro_batch),
    before it pushes a shared node into swap or the kernel's out-of-memory killer. Sampled
    every 10 ms, not enforced by the kernel (docs/scale-out.md)."""

    malloc_mmap_threshold_mb: int = 4
    """glibc's mmap threshold in each training worker, MiB: a freed tensor of at least this size
    goes back to the system instead of leaving a hole in malloc's heap that the next step's
    peak counts (measured at 99.2M parameters, world size 2: 1,105 against 1,250 MiB a
    worker). 0 keeps glibc's own threshold, which moves up to 32 MiB: the heap reuses freed
    memory, a step 4-7% faster at that size, at the higher peak (docs/scale-out.md)."""

    start_method: Literal["spawn", "forkserver", "fork"] = "spawn"
    """Worker start method for the elastic launch."""

    seed: int = 0
    """Global seed; each rank derives its own."""

    deterministic: bool = True
    """torch.use_deterministic_algorithms and fixed threads, so a seed gives a bit-identical loss
    curve on CPU."""

    max_restarts: int = 0
    """Elastic restarts of the worker group after a failure or hang."""

    hang_timeout_s: float = 120.0
    """A rank whose heartbeat is older than this is declared hung; stacks are dumped and the attempt
    ends."""

    spawn_budget_s: float = 90.0
    """Phase budget: seconds a worker may take from launch to its first heartbeat (imports, spawn),
    on top of hang_timeout_s."""

    compile_budget_s: float = 300.0
    """Phase budget of the compile phase (torch.compile is 20-30 s per graph cold on CPU)."""

    checkpoint_budget_s: float = 300.0
    """Phase budget of the checkpoint phase (gathering and writing the model)."""

    first_forward_s_per_gb: float = 60.0
    """Phase budget of a training attempt's first step (its first all-gather of every weight, the
    optimizer's state allocated): hang_timeout_s plus this many seconds per GB of the model's
    weights (init.pt), logged with its reason; 0 = hang_timeout_s whatever the model's size."""

    pg_timeout_s: float = 300.0
    """Process-group timeout during bootstrap and the first step."""

    pg_timeout_steady_s: float = 120.0
    """Process-group timeout after the first step."""

    task_timeout_s: float = 7200.0
    """Prefect task timeout for a whole stage."""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of the runtime."""

    progress: bool = True
    """Progress bars on long work (staging, training, prediction)."""

    progress_every_s: float = 60.0
    """Where no bar shows (output to a file, a pipe, Prefect's or a SLURM job's log): a progress
    line (done of total, rows/s, time left) at most this often while a stage's loop runs;
    0 = none."""

    nnodes: int = 1
    """Machines in the training job; each runs `enn distributed-train` with the same rdzv_endpoint
    and rdzv_id and starts runtime.world_size workers (the job has nnodes x world_size ranks). The
    rendezvous picks the node of global rank 0, which writes model.pt."""

    rdzv_endpoint: str = ""
    """host:port of the c10d rendezvous every node joins (the host runs it: use one node's address);
    empty = a free loopback port (one node only)."""

    rdzv_id: str = ""
    """Job id every node of a multi-node run passes (nodes with the same endpoint and id form one
    job); use a new id for each new job or retry. Empty = a fresh id per launch (one node only)."""

    rdzv_timeout_s: float = 300.0
    """Seconds the nodes wait for each other at the rendezvous (the first node waits for the last to
    start)."""

    local_addr: str = ""
    """Address the other nodes reach this node at (node 0 serves the workers' store on it); empty =
    this machine's hostname."""

    socket_ifname: str = ""
    """Network interface of the workers' collectives: sets GLOO_SOCKET_IFNAME (and
    NCCL_SOCKET_IFNAME) in each worker. Empty: loopback on one node; on several, the interface that
    holds runtime.local_addr (or the address the hostname resolves to; a hostname that resolves to
    loopback is refused), unless the environment already sets GLOO_SOCKET_IFNAME."""

    launcher: Literal["enn", "external"] = "enn"
    """Who starts the workers: `enn` (distributed-train runs torchrun for you: runtime.world_size
    workers per node, in a child process group enn watches) or `external` (torchrun, `srun
    torchrun` or a PyTorchJob started this process as one worker: `python -m flows.worker` sets
    it; docs/scale-out.md)."""

    def __post_init__(self) -> None:
        if self.progress_every_s < 0:
            raise ConfigError(
                f"runtime.progress_every_s={self.progress_every_s} is negative; use seconds "
                "between progress lines (60), or 0 for none"
            )
        if self.world_size < 0:
            raise ConfigError(
                f"runtime.world_size={self.world_size} is negative; "
                "use 0 (auto) or a positive count"
            )
        if self.worker_memory_limit_mb < 0:
            raise ConfigError(
                f"runtime.worker_memory_limit_mb={self.worker_memory_limit_mb} is negative; "
                "use MiB per worker (e.g. 4096), or 0 for no limit"
            )
        if not 0 <= self.malloc_mmap_threshold_mb <= 32:
            raise ConfigError(
                f"runtime.malloc_mmap_threshold_mb={self.malloc_mmap_threshold_mb} is out of "
                "range; use MiB from 1 to 32 (4), or 0 for glibc's own moving threshold"
            )
        if self.threads_per_worker < 0:
            raise ConfigError("runtime.threads_per_worker must be >= 0 (0 = auto)")
        if self.max_restarts < 0:
            raise ConfigError("runtime.max_restarts must be >= 0")
        check_rendezvous(
            self.nnodes,
            self.rdzv_endpoint,
            self.rdzv_id,
            external=self.launcher == "external",
        )
        for name in (
            "hang_timeout_s",
            "rdzv_timeout_s",
            "pg_timeout_s",
            "pg_timeout_steady_s",
            "task_timeout_s",
            "spawn_budget_s",
            "compile_budget_s",
            "checkpoint_budget_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"runtime.{name} must be > 0 seconds")
        if self.first_forward_s_per_gb < 0:
            raise ConfigError(
                "runtime.first_forward_s_per_gb must be >= 0 (0 = the first step's budget is "
                "runtime.hang_timeout_s)"
            )
