"""What the stages after distributed-train need, made ready while its workers train.

While distributed-train's workers train (this process only watches them then), a background
thread imports matplotlib for the loss curves drawn when training ends and scikit-learn for
validate's fitted baselines, and builds MLflow's map of the installed packages (export's model
logging checks its requirements against it): about 1.8 s that otherwise fall inside those
stages, on the critical path of `enn run` (bench/bench_quickstart.py, docs/benchmarks.md). The
thread is distributed-train's: the stage's end waits for what is left of it (`after_stage`).

The thread runs at the kernel's idle priority (SCHED_IDLE, this thread only): the workers use
every core while they train, and a thread at normal priority took its share from them (the
training stage 1.5 to 4 s slower in the A/B run, so it was reverted once). At idle priority it
imports in the cycles the workers leave. Importing is all it does: a module that fails here is
left to the stage that needs it, which says why.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
from collections.abc import Callable, Sequence

from enn_core.stages import DISTRIBUTED_TRAIN, EXPORT, VALIDATE, StageSpec

log = logging.getLogger("enn.warm")
SETTLE_S = 60.0  # the longest distributed-train's end waits for the imports (they take ~2 s)
_warming: list[threading.Thread] = []  # the import thread of this process's current run
LATER: dict[str, tuple[str, ...]] = {
    VALIDATE.name: ("sklearn.linear_model", "sklearn.ensemble"),
}


def later_imports(later: Sequence[StageSpec]) -> list[str]:
    """The modules the stages `later` import when they run, for this config, in that order."""
    return [m for spec in later for m in LATER.get(spec.name, ())]


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


def before_stage(spec: StageSpec, specs: Sequence[StageSpec], plots: bool) -> None:
    """What to start as `spec` of the run's `specs` starts (`plots`: the run is tracked)."""
    if spec != DISTRIBUTED_TRAIN:
        return
    later = specs[specs.index(spec) + 1 :] if spec in specs else ()
    try:  # a head start only: what fails here is left to the stage, which says why
        _warming.append(warm_later(later, plots))
    except RuntimeError as e:  # no thread could start
        log.debug("no head start for the stages after %s: %s", spec.name, e)


def after_stage(spec: StageSpec) -> None:
    """The import thread started with distributed-train ends with it: the stage waits for
    what is left of the imports (none when training outlasted them; else what validate would
    have waited for on its own import lock). Its owner is this stage, so the modules' memory
    is the same stage's at every table size and never lands in a later stage by the clock."""
    if spec != DISTRIBUTED_TRAIN:
        return
    while _warming:
        _warming.pop().join(timeout=SETTLE_S)


def pyplot() -> None:
    from tasks.tracking.plots import _pyplot

    _pyplot()


def installed_packages() -> None:
    """MLflow's map of the installed packages' modules, which it builds (a stat of every file
    of every installed package: 0.3 s) the first time it checks a model's requirements
    against this environment, as export registers the model; "mlflow" is always satisfied, so
    nothing is said here."""
    from mlflow.utils.requirements_utils import warn_dependency_requirement_mismatches

    warn_dependency_requirement_mismatches(["mlflow"])


def warm_later(later: Sequence[StageSpec], plots: bool) -> threading.Thread:
    """Import what `later` needs (matplotlib first when `plots`: the tracker draws the loss
    curves as distributed-train ends) in a daemon thread at idle priority; returns it (tests
    join it)."""
    names = later_imports(later)

    def run() -> None:
        idle_priority()
        steps: list[tuple[str, Callable[[], object]]] = []
        if plots:
            steps.append(("matplotlib", pyplot))
        steps += [(name, functools.partial(importlib.import_module, name)) for name in names]
        if plots and EXPORT in later:
            steps.append(("MLflow's package map", installed_packages))
        for what, step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - the stage does it again and says why
                log.debug("warm-up of %s failed: %s", what, e)

    thread = threading.Thread(target=run, name="enn-warm-imports", daemon=True)
    thread.start()
    return thread
