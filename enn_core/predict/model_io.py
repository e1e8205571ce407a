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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from enn_core.checkpoint import load_model
from enn_core.errors import ConfigError, StaleOutputError
from enn_core.inference import (
    CALIBRATION_FILE,
    FAILED_MARKER,
    INTERCEPT_FILE,
    MODEL_KEY,
    SLOPE_FILE,
    PredictionPath,
    load_calibration,
    read_calibration_meta,
    sha256_file,
)
from enn_core.model.enn import ENN
from enn_core.model_code import BUILTIN, ModelCode
from enn_core.predict.workers import Loader


@dataclass(frozen=True)
class CalibrationChoice:
    """The prediction path predict runs: `applied` or raw, and why: `headline` in a few words
    (predict's console line), `detail` which file or which model hashes."""

    applied: bool
    candidate: str
    headline: str
    directory: str | None = None  # collapse-check output holding calibration.json
    fingerprint: str = "raw"  # hash of the calibration content (part of the parts' model key)
    detail: str = ""

    @property
    def reason(self) -> str:
        """Why, whole (predict's summary)."""
        return f"{self.headline} ({self.detail})" if self.detail else self.headline


def resolve_model_path(model: str, default: Path | None, root: Path) -> Path:
    """`predict.model` (or the pipeline's model `default`) as an existing local file."""
    if model.startswith("models:/"):
        raise ConfigError(
            f"predict.model={model} is a registry URI; run through the task layer (enn run / the "
            "Prefect flow), which resolves it to a local path, or give the checkpoint path"
        )
    if not model and default is None:
        raise ConfigError(
            "predict.model is empty; give a consolidated checkpoint path or models:/NAME@ALIAS"
        )
    path = Path(model) if model else default
    assert path is not None
    path = path if path.is_absolute() else root / path
    if not path.is_file():
        raise StaleOutputError(
            f"{path}: no consolidated checkpoint there; run distributed-train or set predict.model"
        )
    return path


def calibration_dirs(
    model_path: Path, explicit: str, pipeline_dir: Path | None, sibling: str, root: Path
) -> list[Path]:
    """Where collapse-check's output may be, in order: `predict.calibration_dir`, beside the model
    (a registry download), the collapse-check output (folder `sibling`) next to the model's
    stage output, this pipeline's collapse-check output. The model's sha256 decides whether one
    applies."""
    if explicit:
        p = Path(explicit)
        return [p if p.is_absolute() else root / p]
    dirs = [model_path.parent, model_path.parent.parent / sibling]
    if pipeline_dir is not None:
        dirs.append(pipeline_dir)
    return list(dict.fromkeys(d.resolve() for d in dirs))


def find_calibration(dirs: list[Path], model_sha: str, *, use: bool = True) -> CalibrationChoice:
    """The first calibration made for this model; else the first verdict found says why raw."""
    found = [d for d in dirs if (d / CALIBRATION_FILE).is_file() or (d / FAILED_MARKER).exists()]
    choices = [choose_calibration(d, model_sha, use=use) for d in found]
    applied = [c for c in choices if c.applied]
    if applied:
        return applied[0]
    return choices[0] if choices else choose_calibration(dirs[-1], model_sha, use=use)


def choose_calibration(
    collapse_dir: Path, model_sha: str, *, use: bool = True
) -> CalibrationChoice:
    """Apply collapse-check's calibration only when it was made for exactly this model."""
    cal_file = collapse_dir / CALIBRATION_FILE
    if not use:
        return CalibrationChoice(False, "raw", "predict.calibration=raw")
    if (collapse_dir / FAILED_MARKER).exists():
        return CalibrationChoice(
            False,
            "raw",
            "collapse-check found every candidate collapsed",
            detail=str(collapse_dir / FAILED_MARKER),
        )
    # what a person reads on predict's line: in the training flow predict runs before
    # collapse-check, so a fresh model never has a calibration yet; say that, not the hashes
    short = f"{collapse_dir.name}/{CALIBRATION_FILE}"
    if not cal_file.is_file():
        return CalibrationChoice(False, "raw", "collapse-check has not judged this model yet")
    cal = read_calibration_meta(collapse_dir)
    named = cal.get(MODEL_KEY)
    if named != model_sha:
        earlier = _shown(named)[:12]
        why = (
            f"{short} names no model"
            if named is None
            else f"{short} is an earlier model's, {earlier}; this one is {model_sha[:12]}"
        )
        return CalibrationChoice(
            False, "raw", "collapse-check has not judged this model yet", detail=why
        )
    h = hashlib.sha256(json.dumps(cal, sort_keys=True).encode())
    for name in (SLOPE_FILE, INTERCEPT_FILE):
        if (collapse_dir / name).is_file():
            h.update(sha256_file(collapse_dir / name).encode())
    return CalibrationChoice(
        True,
        _shown(cal.get("candidate", "raw"))[:40],  # checked when loaded; printed before
        "collapse-check's choice for this model",
        str(collapse_dir),
        h.hexdigest(),
        detail=str(cal_file),
    )


def _shown(value: object) -> str:
    """A value of calibration.json (a file: it may lie) as printable ASCII, so that a terminal
    escape sequence in it is shown, never run by the terminal."""
    return ascii(str(value))[1:-1]


def prediction_path(model: ENN, choice: CalibrationChoice) -> PredictionPath:
    cal = load_calibration(choice.directory)[0] if choice.applied and choice.directory else None
    return PredictionPath(model, cal).eval()


def load_predictor(
    model_path: str, choice: CalibrationChoice, device: str = "cpu", code: ModelCode = BUILTIN
) -> PredictionPath:
    """What each worker runs: the consolidated checkpoint, unsharded, on its device."""
    model, _ = load_model(model_path, code)
    return prediction_path(model, choice).to(device)


def predictor_loader(
    model_path: str, choice: CalibrationChoice, device: str = "cpu", code: ModelCode = BUILTIN
) -> Loader:
    """`load_predictor` as a record a launched worker runs (JSON arguments)."""
    return Loader(
        "enn_core.predict.model_io:load_recorded",
        (model_path, asdict(choice), device, asdict(code)),
    )


def load_recorded(
    model_path: str, choice: dict[str, Any], device: str, code: dict[str, Any]
) -> PredictionPath:
    """`load_predictor` from a `predictor_loader` record."""
    return load_predictor(model_path, CalibrationChoice(**choice), device, ModelCode(**code))


def model_fingerprint(model_sha: str, choice: CalibrationChoice) -> str:
    """The parts' model key: the weights and the calibration that shape every number."""
    return hashlib.sha256(f"{model_sha}:{choice.fingerprint}".encode()).hexdigest()
