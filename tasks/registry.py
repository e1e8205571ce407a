"""Stage name -> the enn_core function that does its work (imported lazily, so `enn --help`
stays fast and the CLI under `dvc repro` imports only what its stage needs)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from enn_core.paths import STAGES

WORK: dict[str, str] = {
    "stage-data": "enn_core.data.staging:run",
    "prepare-checkpoint": "enn_core.init_checkpoint:run",
    "distributed-train": "enn_core.train.stage:run",
    "validate": "enn_core.validate:run",
    "predict": "enn_core.predict.stage:run",
    "collapse-check": "enn_core.collapse:run",
    "export": "enn_core.export:run",
}

# The prediction pipeline (flows/prediction.py, prediction/dvc.yaml): the same stage names,
# over new data: stage-data in features-only mode, predict with a given model, and
# collapse-check against the training targets' spread (holding back collapsed predictions).
PREDICTION_WORK: dict[str, str] = {
    "stage-data": "enn_core.data.staging:run",
    "predict": "enn_core.predict.pipeline:run_predict",
    "collapse-check": "enn_core.predict.pipeline:run_check",
}
PIPELINES: dict[str, dict[str, str]] = {"training": WORK, "prediction": PREDICTION_WORK}

HELP: dict[str, str] = {
    "stage-data": "Stage the input (npy/npz, CSV, Parquet, workbook or synthetic) to versioned memmaps with a manifest.",
    "prepare-checkpoint": "Write the initial checkpoint: a seeded fresh start or a warm start.",
    "distributed-train": "Train in elastic worker processes (FSDP2 when world size > 1); writes the consolidated checkpoint.",
    "validate": "Metrics on the validation and test splits in real units, against both naive predictors.",
    "predict": "Chunked, resumable prediction in real units (predictions.npy, Parquet, workbook).",
    "collapse-check": "Detect prediction collapse; compare raw, calibrated, fp32 and per-sample candidates; choose one.",
    "export": "Export the chosen prediction path to torch.export and ONNX, with parity checks and a sidecar.",
}

assert tuple(WORK) == STAGES, (
    "registry and enn_core.paths.STAGES must list the same stages in order"
)


def work_fn(stage: str, pipeline: str = "training") -> Callable:
    module, name = PIPELINES[pipeline][stage].split(":")
    return getattr(importlib.import_module(module), name)
