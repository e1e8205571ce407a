"""Inference: the prediction path every consumer runs, and what it is made of.

    ds, model, ckpt = load_trained(staged, trained, stage)   # staged data + consolidated model
    device, why = resolve_device(cfg.runtime.device)
    path = PredictionPath(model, load_calibration(collapse_dir)[0])
    pred = predict_rows(path, ds.features, rows, batch_size, device)   # real units

`PredictionPath(model, calibration)`: raw feature vector [B, F] in, calibrated real units
[B, *label_shape] out (encoding and normalization live in the model's `predict`; the path adds
the candidate's precision, the per-sample loop and the per-output affine). collapse-check
chooses the calibration and writes it (`write_calibration`); validate, predict and export run
the path; `check_model_matches` refuses a calibration made for another model file.

Below validate, collapse-check, predict and export; above the model and the data.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from enn_core.atomic import read_plain, write_json
from enn_core.checkpoint import Checkpoint, load_model
from enn_core.data.dataset import StagedDataset
from enn_core.data.hashing import sha256_file
from enn_core.errors import CollapseError, DataError, StaleOutputError
from enn_core.model_code import BUILTIN, ModelCode
from enn_core.runtime.device import resolve_device

if TYPE_CHECKING:
    from enn_core.model.enn import ENN

CANDIDATES: tuple[str, ...] = ("raw", "calibrated", "fp32", "per_sample")
STD_CHUNK_CELLS = 2_000_000  # label numbers label_std reads at once (float64: 16 MB)
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
FAILED_MARKER = "FAILED"
CALIBRATION_FILE = "calibration.json"
SLOPE_FILE, INTERCEPT_FILE = "slope.npy", "intercept.npy"  # an affine calibration's arrays
MODEL_FILE = "model.pt"
MODEL_KEY = "model_sha256"  # calibration.json names the model file it was chosen for


@dataclass(frozen=True)
class Calibration:
    """The chosen prediction path: candidate, autocast precision, optional per-output affine."""

    candidate: str = "raw"
    precision: str = "fp32"
    slope: np.ndarray | None = None
    intercept: np.ndarray | None = None


class PredictionPath(nn.Module):
    """Raw feature vector [B, F] in, calibrated real units [B, *label_shape] out.

    `per_sample` loops rows, so it is correct for a batch-dependent model but cannot be
    exported with a dynamic batch.
    """

    def __init__(self, model: ENN, calibration: Calibration | None = None) -> None:
        super().__init__()
        cal = calibration or Calibration()
        if cal.candidate not in CANDIDATES:
            raise StaleOutputError(
                f"calibration candidate {cal.candidate!r} is not one of {CANDIDATES}; "
                "re-run collapse-check"
            )
        self.model = model
        self.candidate = cal.candidate
        self.precision = cal.precision
        self.per_sample = cal.candidate == "per_sample"
        self.has_affine = cal.slope is not None
        if self.has_affine:
            slope = torch.as_tensor(np.asarray(cal.slope), dtype=torch.float32)
            intercept = torch.as_tensor(np.asarray(cal.intercept), dtype=torch.float32)
            self.slope: torch.Tensor
            self.intercept: torch.Tensor
            self.register_buffer("slope", slope)
            self.register_buffer("intercept", intercept)

    def _batch(self, x: torch.Tensor) -> torch.Tensor:
        if self.precision in AUTOCAST:
            with torch.autocast(x.device.type, dtype=AUTOCAST[self.precision]):
                y = self.model.predict(x)
        else:
            y = self.model.predict(x)
        y = y.float()
        if self.has_affine:
            y = y * self.slope + self.intercept
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.per_sample:
            return torch.cat([self._batch(x[i : i + 1]) for i in range(x.shape[0])], dim=0)
        return self._batch(x)


def predict_rows(
    fn: Callable[[torch.Tensor], torch.Tensor],
    features: np.ndarray,
    rows: np.ndarray,
    batch_size: int,
    device: torch.device | str = "cpu",
    rows_done: Callable[[int], None] | None = None,
) -> np.ndarray:
    """`fn` (raw features in, real units out) over `features[rows]` in batches -> float32 array;
    `rows_done(n)` after each batch (a stage's progress line: StageContext.ticker)."""
    outs: list[np.ndarray] = []
    with torch.inference_mode():
        for start in range(0, len(rows), batch_size):
            idx = np.asarray(rows[start : start + batch_size])
            x = torch.as_tensor(np.asarray(features[idx]), dtype=torch.float32, device=device)
            outs.append(fn(x).float().cpu().numpy())
            if rows_done is not None:
                rows_done(len(idx))
    if not outs:
        raise DataError(
            "no rows to predict; the split is empty (re-run stage-data with a non-empty split)"
        )
    return np.concatenate(outs, axis=0)


def label_std(ds: StagedDataset, chunk_rows: int | None = None) -> float:
    """The standard deviation of the training rows' labels, every cell pooled (float64): the
    scale that parity tolerances and the broadcast check are relative to. Read in chunks of
    rows (STD_CHUNK_CELLS numbers at a time, whatever the rows; at most `chunk_rows` rows,
    data.chunk_rows), shifted by the first value for accuracy."""
    train = np.asarray(ds.split("train"))
    shift, s1, s2, count = 0.0, 0.0, 0.0, 0
    cap = max(1, STD_CHUNK_CELLS // max(int(np.prod(ds.targets.shape[1:])), 1))
    chunk_rows = min(cap, chunk_rows or cap)
    for start in range(0, len(train), chunk_rows):
        v = np.asarray(ds.targets[train[start : start + chunk_rows]], dtype=np.float64).ravel()
        if count == 0 and v.size:
            shift = float(v[0])
        d = v - shift
        s1, s2, count = s1 + float(d.sum()), s2 + float((d**2).sum()), count + d.size
    if count == 0:
        raise DataError("splits/train.npy is empty; re-run stage-data with training rows")
    return math.sqrt(max(s2 / count - (s1 / count) ** 2, 0.0))


def load_trained(
    staged: Path, trained: Path, stage: str, code: ModelCode = BUILTIN
) -> tuple[StagedDataset, ENN, Checkpoint]:
    """(staged dataset, model in eval mode, checkpoint) for `stage`, which reads the staged data
    and the trained model's folder; refuses features-only data and a model trained on other
    data."""
    ds = StagedDataset(staged)
    if ds.labels is None:
        raise DataError(
            f"{ds.path} is features-only (no labels); {stage} needs the training data's labels: "
            "run it in the training flow (the prediction flow checks new data without targets)"
        )
    path = trained / MODEL_FILE
    if not path.exists():
        raise StaleOutputError(f"{path} not found; run {trained.name} first")
    model, ckpt = load_model(path, code)
    want, have = ckpt.data_fingerprint, ds.fingerprint
    if want and have and want != have:
        raise StaleOutputError(
            f"{path} was trained on data {str(want)[:12]} but {staged} holds {str(have)[:12]}; "
            f"re-run {trained.name} (or {staged.name} with the training inputs)"
        )
    return ds, model, ckpt


# ---------------------------------------------------------------- calibration files


def write_calibration(directory: Path, cal: Calibration, extra: Mapping[str, object]) -> None:
    """calibration.json (+ slope.npy / intercept.npy for an affine) into `directory`."""
    affine = None
    if cal.slope is not None:
        for name, value in ((SLOPE_FILE, cal.slope), (INTERCEPT_FILE, cal.intercept)):
            np.save(directory / name, np.asarray(value, dtype=np.float32), allow_pickle=False)
        affine = {"slope_file": SLOPE_FILE, "intercept_file": INTERCEPT_FILE}
    write_json(
        directory / CALIBRATION_FILE,
        {"candidate": cal.candidate, "precision": cal.precision, "affine": affine, **extra},
    )


def read_calibration_meta(directory: str | Path) -> dict[str, Any]:
    """calibration.json of a collapse-check output as read from the file (candidate not yet
    checked: `load_calibration` checks it and loads the affine arrays)."""
    path = Path(directory) / CALIBRATION_FILE
    if not path.is_file():
        raise StaleOutputError(f"{path} not found; run collapse-check first")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StaleOutputError(f"{path}: not valid JSON ({e}); re-run collapse-check") from e
    if not isinstance(meta, dict):
        raise StaleOutputError(f"{path}: not a calibration record; re-run collapse-check")
    return meta


def load_calibration(directory: str | Path) -> tuple[Calibration, dict[str, Any]]:
    """(Calibration, calibration.json) of a collapse-check output; refuses a failed check."""
    d = Path(directory)
    if (d / FAILED_MARKER).exists():
        raise CollapseError(
            f"{d / FAILED_MARKER}: collapse-check found every candidate collapsed (see "
            f"{d / 'report.json'}); fix or retrain the model and re-run collapse-check"
        )
    path = d / CALIBRATION_FILE
    meta = read_calibration_meta(d)
    if meta.get("candidate") not in CANDIDATES:
        raise StaleOutputError(
            f"{path}: candidate {meta.get('candidate')!r} is not one of {CANDIDATES}; "
            "re-run collapse-check"
        )
    slope = intercept = None
    if meta.get("affine"):  # its own two files, whatever names the record gives (data)
        with read_plain(d / SLOPE_FILE) as f:
            slope = np.load(f, allow_pickle=False)
        with read_plain(d / INTERCEPT_FILE) as f:
            intercept = np.load(f, allow_pickle=False)
    cal = Calibration(meta["candidate"], meta.get("precision", "fp32"), slope, intercept)
    return cal, meta


def check_model_matches(meta: Mapping[str, object], model_path: Path, where: str) -> None:
    """Refuse a calibration made for another model file."""
    want = meta.get(MODEL_KEY)
    if want and want != sha256_file(model_path):
        raise StaleOutputError(
            f"{where} was made for another {model_path.name} than {model_path}; "
            "re-run collapse-check"
        )


__all__ = [
    "AUTOCAST",
    "CALIBRATION_FILE",
    "CANDIDATES",
    "FAILED_MARKER",
    "MODEL_KEY",
    "Calibration",
    "PredictionPath",
    "check_model_matches",
    "label_std",
    "load_calibration",
    "load_trained",
    "predict_rows",
    "read_calibration_meta",
    "resolve_device",
    "sha256_file",
    "write_calibration",
]
