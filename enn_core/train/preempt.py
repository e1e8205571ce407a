"""Preemption: a stop asked from outside ends training with a committed checkpoint that every
rank agreed on, and a restart resumes from it bit for bit.

Who asks: SLURM's time-limit warning (`--signal=USR2@<grace>`, forwarded by the batch script
and torchrun: deploy/slurm/), `scontrol requeue`, preemption and `scancel` (SIGTERM, then
SIGKILL after KillWait), Kubernetes (SIGTERM, then SIGKILL after
terminationGracePeriodSeconds), a cancelled Prefect flow run (the launcher's SIGTERM to its
workers). SIGUSR1 is never one of them: it is the workers' stack-dump signal.

    with PreemptWatch() as watch:        # the worker, around training (with a checkpointer)
        ... train(..., rt with preempt=watch) ...

The contract:

- SIGTERM or SIGUSR2 only sets a flag (any number of times: SLURM signals the workers and
  torchrun forwards the same signal); nothing stops mid-step.
- The ranks agree at every step boundary, in the step's own all-reduce (enn_core.train.step:
  the flag is one more float in the vector every step already sums), so the agreement costs no
  collective of its own; any rank's flag stops every rank at the same step.
- Every rank then saves the checkpoint at that position (after the epoch's last step, the
  epoch is validated and its end-of-epoch checkpoint is the one), waits until it is
  committed, and the worker ends with `Preempted` (exit code 12, `enn_core.errors`):
  "saved for preemption; run the same command again to resume".
- The run is not COMPLETE: the same command (a requeued job, a restarted pod) resumes from the
  newest committed checkpoint, which is this one, and ends bit-identical to an uninterrupted
  run (the checkpoint is an ordinary one: the trajectory does not depend on where it stops).
- Without a checkpointer there is nothing to resume from: the signals keep their default
  action (the process ends at once).

The save must fit in the grace the scheduler gives (KillWait, terminationGracePeriodSeconds,
torchrun's --shutdown-timeout): a step plus one checkpoint's seconds (the run record's
`checkpoint_saved` events say how long one takes).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

from enn_core.runtime import sigterm

SIGNALS = (signal.SIGTERM, signal.SIGUSR2)


class PreemptWatch:
    """The flag the signals set; installed in the worker's main thread around training."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._old: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal = signum
        sigterm.owned()  # the save ends this process: not the SIGTERM helper's 5 s

    def __enter__(self) -> PreemptWatch:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._old.clear()

    def describe(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else "a peer rank's"


__all__ = ["SIGNALS", "PreemptWatch"]
