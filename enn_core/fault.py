"""The one fault-injection facility: raise, hang, delay, kill, NaN or out-of-memory (injected,
or a real allocation too large to succeed) at a named phase, step and rank, or a slow
interconnect (comm_delay). Configured by the `fault` config section, which the loader refuses
outside tests.

Call sites are one line: `faults.at("first_forward", step=step)`; for NaN injection the
caller asks `faults.wants_nan("step", step)` and poisons its own tensor, since only it
knows which tensor. How many times a fault fires is counted in marker files, so a fault
with `times: 1` fires once across elastic restarts and Prefect retries.

`comm_delay` is not fired at a call site: `collective_delays()` hands its sleep to the
collective timing (enn_core.runtime.comm_clock), which sleeps inside every FSDP2 all-gather
or reduce-scatter (`fault.phase`) on `fault.rank`, every time (`step` and `times` do not
apply): a slow link that the peers wait for, as a real one would make them.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from enn_core.config import FaultConfig
from enn_core.errors import EnnError, TransientError

# alloc_numpy / alloc_torch: 256 TiB, more than a 64-bit Linux process can map (its address
# space is 128 TiB), so the allocation fails at once, whatever the machine's memory and its
# overcommit setting, and touches nothing.
ALLOC_BYTES = 2**48


class InjectedFault(EnnError):
    """An injected `raise` fault (tests assert on it)."""


class FaultInjector:
    def __init__(self, cfg: FaultConfig, *, rank: int = 0, marker_dir: str | Path | None = None):
        self.cfg = cfg
        self.rank = rank
        base = cfg.marker_dir or (str(marker_dir) if marker_dir else "")
        self.marker_dir = Path(base) if base else None

    @property
    def active(self) -> bool:
        return self.cfg.kind != "none"

    def _matches(self, phase: str, step: int | None) -> bool:
        c = self.cfg
        if c.kind == "none" or c.phase != phase:
            return False
        if c.rank >= 0 and c.rank != self.rank:
            return False
        if c.step >= 0 and step is not None and step != c.step:
            return False
        return True

    def _claim(self) -> bool:
        """Count a firing; False once `times` firings have happened (across processes)."""
        if self.marker_dir is None:
            return True
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.cfg.times):
            marker = self.marker_dir / f"fault-{self.cfg.kind}-{self.cfg.phase}-{i}"
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue
            os.write(fd, f"{os.getpid()} rank={self.rank}\n".encode())
            os.close(fd)
            return True
        return False

    def wants_nan(self, phase: str, step: int | None = None) -> bool:
        return self.cfg.kind == "nan" and self._matches(phase, step) and self._claim()

    def wants_oom(self, phase: str, step: int | None = None) -> bool:
        return self.cfg.kind == "oom" and self._matches(phase, step) and self._claim()

    def collective_delays(self) -> dict[str, float]:
        """{collective: seconds} for a comm_delay fault on this rank; {} otherwise."""
        if self.cfg.kind != "comm_delay" or not self._matches(self.cfg.phase, None):
            return {}
        return {self.cfg.phase: self.cfg.seconds}

    def at(self, phase: str, step: int | None = None) -> None:
        """Fire a raise/transient/hang/delay/kill/oom/alloc fault if one is configured here."""
        kind = self.cfg.kind
        if kind in ("none", "nan") or not self._matches(phase, step) or not self._claim():
            return
        where = f"phase={phase} step={step} rank={self.rank}"
        if kind == "raise":
            raise InjectedFault(f"injected fault at {where}")
        if kind == "transient":
            raise TransientError(f"injected transient fault at {where}")
        if kind == "oom":
            import torch

            raise torch.OutOfMemoryError(f"injected out-of-memory at {where}")
        if kind == "alloc_numpy":
            import numpy as np

            np.empty(ALLOC_BYTES, dtype=np.uint8)  # numpy's own MemoryError
        if kind == "alloc_torch":
            import torch

            torch.empty(ALLOC_BYTES, dtype=torch.uint8)  # torch's CPU allocator's RuntimeError
        if kind in ("hang", "delay"):
            time.sleep(self.cfg.seconds)
            return
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
