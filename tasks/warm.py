"""The heavy imports of the stages after distributed-train, made in a background thread while
its workers train (this process only watches them then): scikit-learn for validate's fitted
baselines, torch.export's tracer and the ONNX exporter for export, matplotlib for the MLflow
plots. They are about 2.5 s of imports that otherwise fall inside those stages, on the
critical path of `enn run` (bench/bench_quickstart.py, docs/benchmarks.md). Importing is all
it does: a module that fails here is left to the stage that needs it, which says why.
"""

from __future__ import annotations

import importlib
import logging
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
    """The modules the stages `later` import when they run, for this config."""
    names = [m for spec in later for m in LATER.get(spec.name, ())]
    if EXPORT in later and "onnx" in cfg.export.formats:
        names += ONNX
    return names


def warm_later(cfg: RunConfig, later: Sequence[StageSpec], plots: bool) -> threading.Thread:
    """Import what `later` needs (and matplotlib when `plots`: the tracker draws the loss
    curves when distributed-train ends) in a daemon thread; returns it (tests join it)."""
    names = later_imports(cfg, later)

    def run() -> None:
        for name in names:
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - the stage imports it again and says why
                log.debug("warm import of %s failed: %s", name, e)
        if plots:
            from tasks.tracking.plots import _pyplot

            _pyplot()

    thread = threading.Thread(target=run, name="enn-warm-imports", daemon=True)
    thread.start()
    return thread
