"""This process as one worker of a job an external launcher started (torchrun, `srun torchrun`,
a Kubernetes PyTorchJob): what the launcher told it, through the variables it sets.

    launched = LauncherEnv.from_env()     # None when no launcher started this process
    launched.rank, launched.nnodes, launched.restart

Under `runtime.launcher: external` the distributed-train stage runs the training worker in its
own process (enn_core.train.stage) instead of launching workers: the launcher already did, and
it restarts them (`--max-restarts`). These variables are the launcher's interface, read here
and only here (CONVENTIONS: environment variables only for what a launcher sets).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from enn_core.errors import ConfigError

REQUIRED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LauncherEnv:
    """One worker's place in a launcher's job."""

    rank: int  # global rank
    local_rank: int
    world_size: int  # ranks in the job
    local_world_size: int  # ranks on this node
    run_id: str  # the rendezvous id (torchrun's --rdzv-id)
    restart: int  # the launcher's restart count for this node
    max_restarts: int

    @property
    def nnodes(self) -> int:
        """Nodes in the job (the launcher starts the same number of workers on each)."""
        return max(1, self.world_size // max(1, self.local_world_size))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LauncherEnv | None:
        """The launcher's variables, or None when a required one is missing."""
        env = os.environ if env is None else env
        if any(not env.get(k) for k in REQUIRED):
            return None
        try:
            return cls(
                rank=int(env["RANK"]),
                local_rank=int(env["LOCAL_RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                local_world_size=int(env["LOCAL_WORLD_SIZE"]),
                run_id=env.get("TORCHELASTIC_RUN_ID") or "external",
                restart=int(env.get("TORCHELASTIC_RESTART_COUNT") or 0),
                max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0),
            )
        except ValueError as e:
            raise ConfigError(f"the launcher's variables are not numbers ({e})") from None

    @classmethod
    def required(cls) -> LauncherEnv:
        """The launcher's variables; a one-line error naming the missing ones otherwise."""
        found = cls.from_env()
        if found is None:
            missing = [k for k in REQUIRED if not os.environ.get(k)]
            raise ConfigError(
                "runtime.launcher=external: no launcher started this process "
                f"({', '.join(missing)} not set); start it with torchrun "
                "(`torchrun ... -m flows.worker`, "
                "docs/scale-out.md) or use runtime.launcher=enn"
            )
        return found

    def overrides(self) -> list[str]:
        """The config values the launcher decided, as `--set` overrides (recorded with the run)."""
        return [
            "runtime.launcher=external",
            f"runtime.nnodes={self.nnodes}",
            f"runtime.world_size={self.local_world_size}",
            f"runtime.max_restarts={self.max_restarts}",
            f"runtime.rdzv_id={self.run_id}",
        ]
