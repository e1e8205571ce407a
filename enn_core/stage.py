"""The contract between a stage's work (here, in enn_core) and whoever runs it (the Prefect
task, `enn <stage>` under `dvc repro`, or a test).

Every stage is one spec (enn_core/stages/) whose work function `work(cfg, ctx)` reads the
outputs of the stages it declares as inputs (`ctx.input(SPEC)`), writes its own outputs
atomically into `ctx.output()` (enn_core.atomic.atomic_dir), writes metrics and events through
`ctx.events`, and returns a small summary record (paths, hashes, headline metrics). It never
imports prefect, mlflow or dvc.

Cancellation: `ctx.cancel` is a `threading.Event` the runner sets when the run is cancelled
(Prefect flow run set to Cancelling). A stage that launches workers passes it on
(`launch(cancel=ctx.cancel)`), so they are killed within seconds. Whoever builds contexts
without knowing the stage (tasks/runner.py) is covered by `cancel_scope(event)`: contexts
created inside it share `event`; outside any scope each context gets a fresh one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from enn_core.bars import shows
from enn_core.events import EventLog
from enn_core.fault import FaultInjector
from enn_core.paths import Layout
from enn_core.progress import Ticker

if TYPE_CHECKING:
    from enn_core.config import RunConfig

_SCOPE: ContextVar[threading.Event | None] = ContextVar("enn_cancel_scope", default=None)


def current_cancel() -> threading.Event:
    """The event of the innermost `cancel_scope`, or a fresh (never set) one."""
    return _SCOPE.get() or threading.Event()


@contextlib.contextmanager
def cancel_scope(event: threading.Event) -> Iterator[threading.Event]:
    """Stage contexts created inside this block (in this thread or context) use `event`."""
    token = _SCOPE.set(event)
    try:
        yield event
    finally:
        _SCOPE.reset(token)


class StageRef(Protocol):
    """What a context needs of its stage: `enn_core.stages.spec.StageSpec` is one (the
    registry names this contract, never the other way round)."""

    @property
    def key(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def inputs(self) -> tuple[StageRef, ...]: ...
    @property
    def optional_inputs(self) -> tuple[StageRef, ...]: ...
    def output_dir(self, layout: Layout) -> Path: ...


@dataclass(frozen=True)
class StageContext:
    spec: StageRef
    layout: Layout
    run_dir: Path
    events: EventLog
    faults: FaultInjector
    progress: bool = True
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("enn"))
    cancel: threading.Event = field(default_factory=current_cancel)
    progress_every_s: float = 60.0  # runtime.progress_every_s: a loop's line where no bar shows

    @property
    def stage(self) -> str:
        """This stage's public name (messages, progress bars, fault phases)."""
        return self.spec.name

    def ticker(self, total: int | None, unit: str = "rows") -> Ticker:
        """A progress line for one of this stage's loops, every runtime.progress_every_s where
        no bar shows (enn_core.progress.Ticker): `ticker.update(rows_done_now)` in the loop."""
        return Ticker(
            self.stage,
            total,
            unit=unit,
            every_s=self.progress_every_s,
            logger=self.logger,
            quiet=shows(self.progress),
        )

    def output(self) -> Path:
        """This stage's output directory."""
        return self.spec.output_dir(self.layout)

    def input(self, upstream: StageRef) -> Path:
        """The output directory of `upstream`, which this stage's spec must declare."""
        if upstream not in (*self.spec.inputs, *self.spec.optional_inputs):
            raise KeyError(f"{self.spec.key} does not declare {upstream.key} as an input")
        return upstream.output_dir(self.layout)


def make_context(
    cfg: RunConfig,
    layout: Layout,
    spec: StageRef,
    run_id: str,
    cancel: threading.Event | None = None,
) -> StageContext:
    """A context for running a stage directly (tests, benchmarks); `cancel` (default: the
    enclosing `cancel_scope`'s event, or a fresh one) stops its workers when set."""
    run_dir = layout.run_dir(run_id, spec.name)
    run_dir.mkdir(parents=True, exist_ok=True)
    return StageContext(
        spec=spec,
        layout=layout,
        run_dir=run_dir,
        events=EventLog(run_dir),
        faults=FaultInjector(cfg.fault, marker_dir=run_dir.parent),
        progress=cfg.runtime.progress,
        logger=logging.getLogger(f"enn.{spec.name}"),
        cancel=cancel if cancel is not None else current_cancel(),
        progress_every_s=cfg.runtime.progress_every_s,
    )
