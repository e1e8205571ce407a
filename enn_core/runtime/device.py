"""The one device resolver: `runtime.device` (auto, cpu, cuda) to a torch device and a reason.

Stages that run in this process (validate, collapse-check, predict, export) ask for local rank
0; each distributed worker asks for its own local rank. The choice is recorded with its reason.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from enn_core.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where a device is resolved: the core count needs none
    import torch


def resolve_device(requested: str, local_rank: int = 0) -> tuple[torch.device, str]:
    """(device, why) for `runtime.device`; asking for CUDA without a visible device is refused."""
    import torch

    has_cuda = torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise ConfigError(
            "runtime.device=cuda but no CUDA device is visible; set runtime.device=auto or cpu"
        )
    if requested == "cuda" or (requested == "auto" and has_cuda):
        why = "runtime.device=cuda" if requested == "cuda" else "a CUDA device is visible"
        return torch.device("cuda", local_rank), why
    if requested == "auto":
        return torch.device("cpu"), "runtime.device=auto and no CUDA device"
    return torch.device("cpu"), f"runtime.device={requested}"


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a taskset, a cgroup's cpuset, a SLURM
    allocation), not the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_worker(requested: int, world_size: int) -> int:
    """`runtime.threads_per_worker`, or the usable cores shared by the job's workers."""
    return requested if requested > 0 else max(1, usable_cores() // world_size)
