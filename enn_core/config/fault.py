"""Fault injection: raise, hang, delay, kill, inject NaN or run out of memory at a named phase,
step and rank, or slow FSDP2's collectives (comm_delay). Refused outside tests (the loader
checks `allow_faults`)."""

from __future__ import annotations

from typing import Literal

from enn_core.config.fields import frozen
from enn_core.errors import ConfigError

FaultKind = Literal[
    "none",
    "raise",
    "transient",
    "hang",
    "delay",
    "kill",
    "nan",
    "oom",
    "alloc_numpy",
    "alloc_torch",
    "comm_delay",
]
# oom: an injected torch.OutOfMemoryError (what CUDA raises); alloc_numpy and alloc_torch: a
# real allocation of ALLOC_BYTES (enn_core/fault.py), so the allocator's own error is raised.
# comm_delay: `seconds` of sleep inside every FSDP2 collective of this kind, on `rank`.
COMM_DELAY_PHASES = ("all_gather", "reduce_scatter")


@frozen
class FaultConfig:
    kind: FaultKind = "none"
    """What to inject. Tests only: a non-'none' kind is refused unless ENN_ALLOW_FAULTS=1."""

    phase: str = ""
    """Named phase where it fires (e.g. stage-data, bootstrap, first_forward, step, checkpoint,
    predict_chunk)."""

    step: int = -1
    """Step (or chunk) index where it fires; -1 means the first time the phase is reached."""

    rank: int = -1
    """Rank where it fires; -1 means every rank."""

    seconds: float = 3600.0
    """Duration of a hang or delay."""

    times: int = 1
    """How many times it fires (a transient fault that succeeds on retry uses 1)."""

    marker_dir: str = ""
    """Directory where fired faults are counted across processes and retries; empty = the run
    directory."""

    def __post_init__(self) -> None:
        if self.times < 1:
            raise ConfigError("fault.times must be >= 1")
        if self.kind != "none" and not self.phase:
            raise ConfigError(f"fault.kind={self.kind} needs fault.phase (where to fire it)")
        if self.kind == "comm_delay" and self.phase not in COMM_DELAY_PHASES:
            raise ConfigError(
                f"fault.kind=comm_delay slows FSDP2's own collectives: set fault.phase to one of "
                f"{', '.join(COMM_DELAY_PHASES)} (got {self.phase!r})"
            )
