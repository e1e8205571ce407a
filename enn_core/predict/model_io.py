"""Which model and which prediction path predict runs, and how a worker loads it.

- The model is a consolidated checkpoint path (`predict.model`, default this pipeline's
  `outputs/distributed-train/model.pt`). A registry URI (`models:/name@champion`) is resolved
  into a local path by the task layer before enn_core runs, so here it is an error.
- The prediction path is collapse-check's chosen candidate (`enn_core.collapse.PredictionPath`)
  when `outputs/collapse-check/calibration.json` exists, carries no FAILED marker beside it and
  names this model's sha256; otherwise the raw path. The decision and its reason are recorded,
  so predict's numbers equal the exported model's whenever the calibration applies.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from enn_core.checkpoint import load_model
from enn_core.collapse import CALIBRATION_FILE, FAILED_MARKER, Calibration, PredictionPath
from enn_core.errors import ConfigError, StaleOutputError
from enn_core.predict.chunks import sha256_file

# Keys under which calibration.json may name the model it was chosen for.
MODEL_KEYS = ("model_sha256", "model_fingerprint")


@dataclass(frozen=True)
class CalibrationChoice:
    """The prediction path predict runs: `applied` or raw, and why."""

    applied: bool
    candidate: str
    reason: str
    directory: str | None = None  # collapse-check output holding calibration.json
    fingerprint: str = "raw"  # hash of the calibration content (part of the parts' model key)


def resolve_model_path(model: str, default: Path, root: Path) -> Path:
    """`predict.model` (or the pipeline's model) as an existing local file."""
    if model.startswith("models:/"):
        raise ConfigError(
            f"predict.model={model} is a registry URI; run through the task layer (enn run / the "
            "Prefect flow), which resolves it to a local path, or give the checkpoint path"
        )
    path = Path(model) if model else default
    path = path if path.is_absolute() else root / path
    if not path.is_file():
        raise StaleOutputError(
            f"{path}: no consolidated checkpoint there; run distributed-train or set predict.model"
        )
    return path


def choose_calibration(
    collapse_dir: Path, model_sha: str, *, use: bool = True
) -> CalibrationChoice:
    """Apply collapse-check's calibration only when it was made for exactly this model."""
    cal_file = collapse_dir / CALIBRATION_FILE
    if not use:
        return CalibrationChoice(False, "raw", "predict.calibration=raw")
    if (collapse_dir / FAILED_MARKER).exists():
        return CalibrationChoice(
            False, "raw", f"{collapse_dir} holds a FAILED marker (every candidate collapsed)"
        )
    if not cal_file.is_file():
        return CalibrationChoice(
            False, "raw", f"no {cal_file} (collapse-check has not run for this model)"
        )
    try:
        cal = json.loads(cal_file.read_text())
    except json.JSONDecodeError as e:
        raise StaleOutputError(f"{cal_file}: not valid JSON ({e}); re-run collapse-check") from e
    named = next((cal[k] for k in MODEL_KEYS if cal.get(k)), None)
    if named != model_sha:
        why = (
            "names no model"
            if named is None
            else f"was made for model {str(named)[:12]}, not {model_sha[:12]}"
        )
        return CalibrationChoice(False, "raw", f"{cal_file} {why}")
    h = hashlib.sha256(json.dumps(cal, sort_keys=True).encode())
    for name in ("slope.npy", "intercept.npy"):
        if (collapse_dir / name).is_file():
            h.update(sha256_file(collapse_dir / name).encode())
    return CalibrationChoice(
        True,
        str(cal.get("candidate", "raw")),
        f"{cal_file} matches the model",
        str(collapse_dir),
        h.hexdigest(),
    )


def read_calibration(directory: str | Path) -> Calibration:
    """The Calibration that collapse-check wrote into `directory`."""
    directory = Path(directory)
    cal = json.loads((directory / CALIBRATION_FILE).read_text())
    affine = cal.get("affine") or {}
    slope = intercept = None
    if affine:
        slope = np.load(directory / affine.get("slope_file", "slope.npy"))
        intercept = np.load(directory / affine.get("intercept_file", "intercept.npy"))
    return Calibration(
        candidate=str(cal.get("candidate", "raw")),
        precision=str(cal.get("precision", "fp32")),
        slope=slope,
        intercept=intercept,
    )


def prediction_path(model: torch.nn.Module, choice: CalibrationChoice) -> PredictionPath:
    cal = read_calibration(choice.directory) if choice.applied and choice.directory else None
    return PredictionPath(model, cal).eval()


def load_predictor(
    model_path: str, choice: CalibrationChoice, device: str = "cpu"
) -> PredictionPath:
    """What each worker runs: the consolidated checkpoint, unsharded, on its device."""
    model, _ = load_model(model_path)
    return prediction_path(model, choice).to(device)


def model_fingerprint(model_sha: str, choice: CalibrationChoice) -> str:
    """The parts' model key: the weights and the calibration that shape every number."""
    return hashlib.sha256(f"{model_sha}:{choice.fingerprint}".encode()).hexdigest()
