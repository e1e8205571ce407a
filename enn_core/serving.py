"""A trained model as a table in, a table out: what MLflow's pyfunc flavor and serving call.

    model = TableModel.load(folder)   # model.pt, calibration.json (+ slope/intercept .npy)
    out = model.predict(df)           # raw named columns in -> named outputs in real units

The input is a pandas DataFrame holding the training features' columns with values as the
source spells them (month "01", day type "mon"; continuous columns as numbers). They are
encoded with the model's own frozen feature specs (enn_core.data.encode.Encoder), so an
unseen category is one line naming the column, the value and the row, and a missing column
names what the model takes. The output has one float column per label cell, named as
predictions.parquet names them (`s00|07`: section s00, hour 07), in real units after the
chosen calibration.

`decode` turns staged rows back into the source's spellings; `columns` says each input
column's type (the MLflow signature is built from it in tasks/tracking/pyfunc.py) and `typed`
gives a frame those types.

No mlflow here: the task layer's loader module wraps this class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from enn_core.checkpoint import Checkpoint, DataSpec, model_from_checkpoint, read_checkpoint
from enn_core.config import DataConfig
from enn_core.data.encode import Encoder, value_key
from enn_core.data.sources import Chunk
from enn_core.errors import DataError
from enn_core.export import FILES
from enn_core.inference import MODEL_FILE, PredictionPath, load_calibration, predict_rows
from enn_core.onnx_program import ort_runner
from enn_core.predict.outputs import cell_names

BATCH = 256


def columns(specs: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(name, type) of each input column, as MLflow's signature types it: "double" for a
    continuous or cyclic feature; "string" for a categorical one spelled as text (day type
    "mon"); "long" for a categorical one whose values are whole numbers (month "01" is the
    number 1, as every CSV reader and JSON client gives it; the model reads it by its
    spelling). A numeric column typed as text would refuse what `mlflow models predict -t csv`
    reads, and one typed Any makes the scoring server refuse every CSV body."""
    return [(s["name"], _column_type(s)) for s in specs]


def _column_type(spec: Mapping[str, Any]) -> str:
    if spec["kind"] != "categorical":
        return "double"
    vocab = [str(v) for v in spec.get("vocab") or []]
    whole = bool(vocab) and all(v.lstrip("-").isdigit() for v in vocab)
    # "01" and "1" both in a vocabulary would be one number: keep such a column text
    return "long" if whole and len({int(v) for v in vocab}) == len(vocab) else "string"


def typed(frame: pd.DataFrame, specs: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """`frame` (a `decode`d one) with each column in its signature type (`columns`): a whole
    number category as the number (month "01" -> 1), what MLflow's clients send."""
    out = frame.copy()
    for name, kind in columns(specs):
        if kind == "long":
            out[name] = out[name].astype("int64")
    return out


def output_names(data: DataSpec) -> list[str]:
    """The output columns: one per label cell, in C order."""
    return cell_names(list(data.label_shape), list(data.label_axes), data.label_axis_values)


def decode(features: np.ndarray, specs: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Staged feature rows [N, F] back to the source's spellings (the inverse of Encoder)."""
    out: dict[str, Any] = {}
    for j, spec in enumerate(specs):
        col = np.asarray(features[:, j], dtype=np.float64)
        if spec["kind"] == "categorical":
            vocab = list(spec.get("vocab") or [])
            out[spec["name"]] = [vocab[int(v)] for v in col]
        else:
            out[spec["name"]] = col
    return pd.DataFrame(out)


@dataclass
class TableModel:
    """The prediction path of one trained model, called with a DataFrame of raw columns."""

    path: Callable[[torch.Tensor], torch.Tensor]  # raw features [B, F] -> real units
    checkpoint: Checkpoint
    where: str = "input"

    @classmethod
    def load(cls, folder: str | Path) -> TableModel:
        """From a folder holding model.pt and collapse-check's calibration.json (the `enn/`
        folder of a registered model, or a training pipeline's outputs copied together).

        A custom model (`model.preset: custom`) runs its exported ONNX program (`model.onnx`,
        the same prediction path, parity-checked by export): serving imports none of the
        user's code, so that a model file never chooses what code runs."""
        folder = Path(folder)
        ckpt = read_checkpoint(folder / MODEL_FILE)
        if ckpt.model_config.get("preset") == "custom":
            return cls(_onnx_path(folder), ckpt)
        model = model_from_checkpoint(ckpt, where=str(folder / MODEL_FILE)).eval()
        calibration, _ = load_calibration(folder)
        return cls(PredictionPath(model.float(), calibration).eval(), ckpt)

    @property
    def specs(self) -> list[dict[str, Any]]:
        return [dict(s) for s in self.checkpoint.data.feature_specs]

    @property
    def input_columns(self) -> list[tuple[str, str]]:
        return columns(self.specs)

    @property
    def output_columns(self) -> list[str]:
        return output_names(self.checkpoint.data)

    def encode(self, frame: pd.DataFrame) -> np.ndarray:
        """The raw columns of `frame` as the model's feature matrix [N, F] (float32)."""
        if not isinstance(frame, pd.DataFrame):
            frame = pd.DataFrame(frame)
        names = [s["name"] for s in self.specs]
        missing = [n for n in names if n not in frame.columns]
        if missing:
            raise DataError(
                f"{self.where}: column(s) {missing} missing; the model takes the columns "
                f"{names} (values as the training data spells them)"
            )
        if len(frame) == 0:
            raise DataError(f"{self.where}: no rows; give at least one row of {names}")
        cols = {
            n: _as_source(frame[n].to_numpy(), spec)
            for n, spec in zip(names, self.specs, strict=True)
        }
        encoder = Encoder(names, DataConfig(), frozen=self.specs)
        chunk = Chunk(start=0, cols=cols, where=lambda i: f"row {i}")
        return np.ascontiguousarray(encoder.encode(chunk, self.where), dtype=np.float32)

    def predict(self, frame: pd.DataFrame, params: Mapping[str, Any] | None = None) -> pd.DataFrame:
        """Real-unit predictions, one named column per label cell, one row per input row."""
        x = self.encode(frame)
        rows = np.arange(len(x))
        pred = predict_rows(self.path, x, rows, BATCH, torch.device("cpu"))
        flat = pred.reshape(len(x), -1).astype(np.float64)
        index = frame.index if isinstance(frame, pd.DataFrame) else None
        return pd.DataFrame(flat, columns=self.output_columns, index=index)


def _onnx_path(folder: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    onnx_file = folder / FILES["onnx"]
    if not onnx_file.is_file():
        raise DataError(
            f"{folder}: a custom model is served from its ONNX program, and "
            f"{onnx_file.name} is not there; keep onnx in export.formats and re-run export"
        )
    runner = ort_runner(onnx_file)
    return lambda x: torch.from_numpy(np.ascontiguousarray(runner(x.numpy())))


def _as_source(col: np.ndarray, spec: Mapping[str, Any]) -> np.ndarray:
    """A column as the encoder reads a source's: categorical values as text (a number given
    for a categorical feature is spelled as the training data spells it: 1 -> "1", 1.0 ->
    "1"), other columns as given."""
    if spec["kind"] != "categorical":
        return col
    return np.asarray(
        [v if isinstance(v, str) or pd.isna(v) else value_key(v) for v in col], object
    )
