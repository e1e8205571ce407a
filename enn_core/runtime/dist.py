"""Worker bootstrap, parallelism and cross-rank agreement.

Run inside each worker (launched by enn_core.runtime.launch):

    env = bootstrap(device=..., threads=..., seed=..., pg_timeout_s=..., hsdp_replicas=...)
    model = apply_parallelism(model, env, param_dtype=..., compile=..., fsdp=...)
    ...
    tighten_timeout(env, seconds)      # after the first step
    shutdown(env)                      # at exit (after `del model, optimizer`)

Facts this module is built on (../shared/reference/FIELD_NOTES.md): elastic_launch does not
set the thread count (two ranks oversubscribe two cores), FSDP2 needs an explicit CPU mesh,
the default gloo timeout is 30 minutes, restarts on gloo read stale addresses from the
agent's shared store unless the group is built on a per-attempt PrefixStore, and FSDP2 on
gloo may abort at interpreter exit unless the model is collected before the group is
destroyed.

HSDP: with `hsdp_replicas` R > 1 the mesh is 2-D, (R, world / R) named ("replicate",
"shard"); fully_shard on a 2-D mesh shards each parameter within a row and all-reduces
gradients across rows (FSDP2's HSDP). What gathers through DTensor (full state dicts, DCP)
works unchanged on it; a sum over ranks of local shard values counts each shard
`env.replicas` times (divide by it, as the grad norm must).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import errno
import gc
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from enn_core.errors import ConfigError
from enn_core.runtime import torch_private
from enn_core.runtime.bound_store import tcp_store
from enn_core.runtime.device import resolve_device
from enn_core.runtime.network import InterfaceChoice
from enn_core.runtime.sigterm import watch_sigterm

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Variables a previous distributed job (or a parent torchrun) may leave in the launcher's
# environment; the launcher removes them so each worker sees only what its agent sets.
STALE_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
)


@dataclass(frozen=True)
class DistEnv:
    """What a worker knows about its place in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    restart: int  # the job's attempt, agreed across ranks (see _agreed_restart)
    mesh: DeviceMesh | None  # None without a process group (local_env)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def replicas(self) -> int:
        """HSDP replicate degree: how many ranks hold each shard (1 under plain FSDP)."""
        return self.mesh.shape[0] if self.mesh is not None and self.mesh.ndim == 2 else 1


def set_threads(threads: int) -> int:
    """Thread count inside the worker (the launcher cannot: elastic_launch does not set it)."""
    threads = max(1, threads)
    torch.set_num_threads(threads)
    return threads


def seed_everything(seed: int, rank: int) -> int:
    """Per-rank seed (dropout etc. differ per rank; data order uses the global seed)."""
    s = seed * 1000 + rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    return s


def set_deterministic(on: bool, *, compile: bool = False) -> None:
    """Deterministic algorithms. The public setter imports torch._inductor (7 s on a loaded
    2-core machine) only to mirror the flag into Inductor's config, which matters only when
    compiling; without compile the C-level switch is the same setting."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # required by CUDA determinism
    if compile:
        torch.use_deterministic_algorithms(on, warn_only=False)
    else:
        torch._C._set_deterministic_algorithms(on)


def worker_device(requested: str, local_rank: int) -> torch.device:
    """This worker's device (runtime.device's one resolver), made current when it is CUDA."""
    dev, _ = resolve_device(requested, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(local_rank)
    return dev


def _store(rank: int, restart: int) -> dist.Store:
    """The rendezvous store under a per-run, per-attempt prefix (the restart-race fix)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    hosting = not agent_store and rank == 0
    try:
        base = tcp_store(  # rank 0's server listens on MASTER_ADDR only, not every interface
            host,
            port,
            is_master=hosting,
            wait_for_workers=False,
            timeout=_dt.timedelta(seconds=120),
        )
    except OSError as e:  # the port is taken: another process hosts it (another rank 0?)
        if not (hosting and e.errno == errno.EADDRINUSE):
            raise
        base = tcp_store(
            host, port, is_master=False, wait_for_workers=False, timeout=_dt.timedelta(seconds=10)
        )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    # The agent's shared store outlives attempts: key by restart count. Without it (the
    # multi-node launch), rank 0 hosts a fresh store per rendezvous round, and the restart
    # count is not a shared key there: agents that restart for a membership change do not
    # count it, so nodes may disagree on it.
    attempt = f"attempt{restart}" if agent_store else "round"
    store = dist.PrefixStore(f"enn/{run_id}/{attempt}", base)
    claim_rank(store, rank)
    return store


def claim_rank(store: dist.Store, rank: int) -> None:
    """The first process to claim `rank` in this attempt owns it; a second is one line naming
    both (hand-set RANK variables, two launchers started with one id), before the group
    forms and hangs."""
    me = f"{os.uname().nodename} pid {os.getpid()}"
    got = store.compare_set(f"rank-owner/{rank}", "", me)
    owner = got.decode(errors="replace") if isinstance(got, bytes) else str(got)
    if owner != me:
        raise ConfigError(
            f"two processes claim rank {rank}: {owner} and {me} (this one); every process of "
            "the job needs its own RANK (torchrun assigns them: do not set RANK by hand)"
        )


def bootstrap(
    *,
    device: str,
    threads: int,
    seed: int,
    deterministic: bool,
    pg_timeout_s: float,
    compile: bool = False,
    hsdp_replicas: int = 1,
    interface: InterfaceChoice | None = None,
) -> DistEnv:
    """Threads, seeds, determinism, process group and device mesh for this worker.

    `hsdp_replicas` (train.hsdp_replicas) > 1 makes the mesh 2-D: replicate x shard;
    `interface` (enn_core.runtime.network) is where the collectives' sockets go."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    shape, names = mesh_layout(world, hsdp_replicas)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    set_threads(threads)
    watch_sigterm(rank)  # a rank blocked in a C++ wait for a peer still stops on SIGTERM
    seed_everything(seed, rank)
    set_deterministic(deterministic, compile=compile)
    dev = worker_device(device, local_rank)
    # CPU collectives (metrics, agreement flags) always have gloo; NCCL carries CUDA tensors.
    backend = "cuda:nccl,cpu:gloo" if dev.type == "cuda" else "gloo"
    if interface is not None:
        interface.apply()  # read by gloo and NCCL when the group is created
    dist.init_process_group(
        backend=backend,
        store=_store(rank, restart),
        rank=rank,
        world_size=world,
        timeout=_dt.timedelta(seconds=pg_timeout_s),
    )
    restart = _agreed_restart(restart, world)
    from torch.distributed.device_mesh import init_device_mesh

    # Explicit mesh on the worker's device type: without one FSDP2 picks CUDA when it exists.
    mesh = init_device_mesh(dev.type, shape, mesh_dim_names=names)
    return DistEnv(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        device=dev,
        backend=backend,
        restart=restart,
        mesh=mesh,
    )


def _agreed_restart(restart: int, world: int) -> int:
    """The job's attempt, the same on every rank: the highest agent restart count. On several
    nodes the counts differ (an agent restarting its group because a peer node rejoined does
    not count it), and decisions keyed by the attempt (resume the newest checkpoint) must
    not."""
    if world == 1:
        return restart
    t = torch.tensor([restart], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def mesh_layout(world: int, hsdp_replicas: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(mesh shape, dim names): 1-D ("shard",) for FSDP, 2-D ("replicate", "shard") for HSDP."""
    if hsdp_replicas < 1:
        raise ConfigError(f"train.hsdp_replicas={hsdp_replicas} must be >= 1 (1 = plain FSDP)")
    if hsdp_replicas == 1:
        return (world,), ("shard",)
    if world % hsdp_replicas:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ConfigError(
            f"train.hsdp_replicas={hsdp_replicas} does not divide runtime.world_size={world}; "
            f"pick one of {divisors} or change runtime.world_size"
        )
    return (hsdp_replicas, world // hsdp_replicas), ("replicate", "shard")


def local_env(device: str = "cpu") -> DistEnv:
    """World size 1 in the calling process, no process group (tests, benchmarks): every
    agreement helper is then the identity, as it is for a 1-worker job."""
    dev = worker_device(device, 0)
    return DistEnv(
        rank=0, world_size=1, local_rank=0, device=dev, backend="none", restart=0, mesh=None
    )


def tighten_timeout(seconds: float) -> None:
    """Shorter collective timeout once warm-up (spawn, wrap, first step) is over.

    There is no public setter in torch 2.13 (FIELD_NOTES); the private one is the only way
    (enn_core.runtime.torch_private)."""
    if dist.is_initialized():
        torch_private.set_default_timeout(_dt.timedelta(seconds=seconds))


def apply_parallelism(
    model: nn.Module,
    env: DistEnv,
    *,
    param_dtype: torch.dtype | None = None,
    compile: bool = False,
    fsdp: bool = True,
) -> tuple[nn.Module, dict[str, Any]]:
    """Wrap a plain model for this job; returns (model, record of what was applied).

    The order is fixed (torchtitan's): 1. move to the device; 2. compile each block (so the
    sharding hooks stay outside the compiled graphs; eager fallback on failure); 3. shard
    each block, then the root (the root owns the leftover parameters: encoder, head); or
    DDP when `fsdp` is off. At world size 1 the model stays plain: nothing to shard.
    """
    record: dict[str, Any] = {"world_size": env.world_size, "compile": "off", "wrap": "none"}
    model.to(env.device)
    if compile:
        record["compile"] = _compile_blocks(model)
    if not env.distributed:
        return model, record
    hsdp = env.mesh is not None and env.mesh.ndim == 2
    if not fsdp:
        if hsdp:
            raise ConfigError(
                "train.hsdp_replicas > 1 needs train.fsdp=true (DDP replicates everything); "
                "set train.hsdp_replicas=1 or train.fsdp=true"
            )
        from torch.nn.parallel import DistributedDataParallel

        ids = [env.device.index] if env.device.type == "cuda" else None
        record["wrap"] = "ddp"
        if dist.get_debug_level() == dist.DebugLevel.DETAIL:
            # torch 2.13 on gloo: DDP's construction logger segfaults on a DETAIL-wrapped group
            raise ConfigError(
                "train.fsdp=false (DDP) crashes under TORCH_DISTRIBUTED_DEBUG=DETAIL "
                "in torch 2.13; "
                "unset TORCH_DISTRIBUTED_DEBUG or use train.fsdp=true"
            )
        # No buffer of these models changes while training (label statistics, the neighbour
        # prior's training rows), so DDP need not re-broadcast them before every forward.
        return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False), record
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    mp = (
        MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        if param_dtype
        else MixedPrecisionPolicy()
    )
    for block in _blocks(model):
        fully_shard(block, mesh=env.mesh, mp_policy=mp)
    # The root takes the RAW feature row: cast to bf16 it would round codes above 256 and
    # continuous values (the encoder and the neighbour prior read it in float64); the blocks
    # still cast their inputs (activations) to param_dtype.
    root_mp = dataclasses.replace(mp, cast_forward_inputs=False)
    fully_shard(model, mesh=env.mesh, mp_policy=root_mp)
    if env.device.type == "cpu":
        _one_unit_at_a_time(model)
    if hasattr(model, "predict"):  # predict() calls forward directly: give it the root hooks
        register_fsdp_forward_method(model, "predict")
    record["wrap"] = "hsdp" if hsdp else "fsdp2"
    # a distributed env has the mesh bootstrap() built
    record["mesh"] = "x".join(str(n) for n in cast("DeviceMesh", env.mesh).shape)
    record["param_dtype"] = str(param_dtype or torch.float32).replace("torch.", "")
    return model, record


def _one_unit_at_a_time(model: nn.Module) -> None:
    """On the CPU, a worker holds one FSDP2 unit's gathered weights and gradients at a time.

    FSDP2's defaults overlap communication with compute on CUDA streams, and each overlap
    keeps a whole unit more alive; a CPU has no streams to overlap, so each only raises the
    peak (measured on a 99.2M-parameter model of 8 units at world size 2, one step's peak
    1,130 -> 1,080 MiB):
    - the forward keeps each unit's all-gather buffer until the next unit's is copied out:
      with async_op=True it is freed once copied out (torch_private.unshard_without_deferral);
    - the backward gathers the next unit while this one computes (implicit prefetch): each
      unit set to prefetch only itself, already gathered, turns it off;
    - the backward keeps each unit's reduce-scatter input until the next unit's: the timed
      reduce-scatter (enn_core.runtime.comm_clock) frees it once the collective returned.
    """
    from torch.distributed.fsdp import FSDPModule

    torch_private.unshard_without_deferral(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_modules_to_backward_prefetch([module])


def _blocks(model: nn.Module) -> nn.ModuleList:
    """The model's `blocks` (the ENN presets' nn.ModuleList, enn_core.model.enn)."""
    return cast(nn.ModuleList, model.blocks)


def _compile_blocks(model: nn.Module) -> str:
    try:
        blocks = _blocks(model)
        for i, block in enumerate(blocks):
            # torch.compile of a module returns an OptimizedModule; its stubs say "a callable"
            blocks[i] = cast(nn.Module, torch.compile(block))
    except (RuntimeError, AssertionError) as e:  # noqa: B014 - Dynamo raises either
        return f"eager (compile failed: {str(e).splitlines()[0][:120]})"
    return "blocks"


def all_reduce_sum(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a small float64 CPU vector across ranks (gloo lane); identity at world size 1."""
    if env.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def agree_any(flag: bool, env: DistEnv) -> bool:
    """True on every rank when it is true on any rank (skip, back off, stop)."""
    if not env.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def _json_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def _json_of(buf: torch.Tensor, size: int) -> Any:
    return json.loads(bytes(buf[:size].tolist()).decode())


def gather_objects(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's `obj`, a JSON value (rare paths only: error reports, the plan check). JSON,
    not torch's pickled object collectives: what a peer sends is data, never code."""
    if not env.distributed:
        return [obj]
    data = _json_tensor(obj)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(env.world_size)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64))
    top = max(int(s.item()) for s in sizes)
    padded = torch.zeros(top, dtype=torch.uint8)
    padded[: data.numel()] = data
    bufs = [torch.zeros(top, dtype=torch.uint8) for _ in range(env.world_size)]
    dist.all_gather(bufs, padded)
    return [_json_of(b, int(s.item())) for b, s in zip(bufs, sizes, strict=True)]


def broadcast_json(value: Any, src: int = 0) -> Any:
    """Rank `src`'s `value` (a JSON value) on every rank of the default group."""
    rank = dist.get_rank()
    data = _json_tensor(value) if rank == src else torch.zeros(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    dist.broadcast(size, src=src)
    buf = data if rank == src else torch.zeros(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=src)
    return _json_of(buf, int(size.item()))


def ranks_not_sharing(directory: str | os.PathLike, env: DistEnv) -> list[int]:
    """Ranks that do not see `directory` as rank 0 does (a node-local disk in a multi-node job;
    DCP needs every rank's shard files and rank 0's metadata in one directory): rank 0 writes
    a probe, every rank looks for it. A collective: every rank calls it."""
    if not env.distributed:
        return []
    token = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}/{env.restart}"
    probe = Path(directory) / f".shared-probe-{token.replace('/', '-')}"
    if env.is_main:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
    dist.barrier()
    seen = probe.is_file() and probe.read_text() == token
    flags = gather_objects(seen, env)  # every rank has looked once this returns
    if env.is_main:
        probe.unlink(missing_ok=True)
    return [r for r, ok in enumerate(flags) if not ok]


def shutdown() -> None:
    """Collect FSDP state before destroying the group (the exit-abort fix)."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
