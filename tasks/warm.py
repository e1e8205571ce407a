"""The heavy imports of the stages after distributed-train, made in a background thread while
its workers train (this process only watches them then): matplotlib for the loss curves drawn
when training ends, scikit-learn for validate's fitted baselines, torch.export's tracer and the
ONNX exporter for export. They are about 2.5 s of imports that otherwise fall inside those
stages, on the critical path of `enn run` (bench/bench_quickstart.py, docs/benchmarks.md).

The thread runs at the kernel's idle priority (SCHED_IDLE, this thread only): the workers use
every core while they train, and a thread at normal priority took its share from them (the
training stage 1.5 to 4 s slower in the A/B run, so it was reverted once). At idle priority it
imports in the cycles the workers leave. Importing is all it does: a module that fails here is
left to the stage that needs it, which says why.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Sequence

from enn_core.config import RunConfig
from enn_core.stages import EXPORT, VALIDATE, StageSpec

log = logging.getLogger("enn.warm")
LATER: dict[str, tuple[str, ...]] = {
    VALIDATE.name: ("sklearn.linear_model", "sklearn.ensemble"),
    EXPORT.name: ("torch.export._trace",),
}
ONNX = ("torch.onnx._internal.exporter._core", "onnxruntime")  # export.formats has onnx


def later_imports(cfg: RunConfig, later: Sequence[StageSpec]) -> list[str]:
    """The modules the stages `later` import when they run, for this config, in that order."""
    names = [m for spec in later for m in LATER.get(spec.name, ())]
    if EXPORT in later and "onnx" in cfg.export.formats:
        names += ONNX
    return names


def idle_priority() -> bool:
    """The calling thread (not its process) to the idle scheduling class; False where the
    platform has none (the thread then imports at normal priority)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread on Linux
    except OSError as e:
        log.debug("idle priority refused: %s", e)
        return False
    return True


def warm_later(cfg: RunConfig, later: Sequence[StageSpec], plots: bool) -> threading.Thread:
    """Import what `later` needs (matplotlib first when `plots`: the tracker draws the loss
    curves as distributed-train ends) in a daemon thread at idle priority; returns it (tests
    join it)."""
    names = later_imports(cfg, later)

    def run() -> None:
        idle_priority()
        if plots:
            from tasks.tracking.plots import _pyplot

            _pyplot()
        for name in names:
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - the stage imports it again and says why
                log.debug("warm import of %s failed: %s", name, e)

    thread = threading.Thread(target=run, name="enn-warm-imports", daemon=True)
    thread.start()
    return thread
