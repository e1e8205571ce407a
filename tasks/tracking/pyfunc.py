"""The registered model's pyfunc flavor: a loader module of the installed project.

MLflow loads a model saved with `loader_module="tasks.tracking.pyfunc"` by importing this
module and calling `_load_pyfunc(<model>/data/enn)`; nothing in the model's folder is code or
a pickle (a `python_model` is cloudpickled and a models-from-code file is code: both would
run what the artifact holds). The folder holds what enn_core reads as data: the consolidated
checkpoint (loaded weights-only), the calibration, the sidecar, the collapse report, and the
ONNX and torch.export programs, which the `onnx` flavor of the same MLmodel points at.

    mlflow.pyfunc.load_model("models:/<name>@champion").predict(df)

takes the raw named columns (enn_core/serving.py) and returns named outputs in real units.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from enn_core.errors import DataError
from enn_core.serving import TableModel, decode, typed

if TYPE_CHECKING:
    from mlflow.models import Model
    from mlflow.models.signature import ModelSignature

LOADER_MODULE = __name__
DATA_DIR = "enn"  # the folder under the model's `data/` that `_load_pyfunc` receives
ONNX_FILE = "model.onnx"
EXAMPLE_ROWS = 2


class EnnPyfunc:
    """What `mlflow.pyfunc` calls: a DataFrame of raw columns in, named outputs out."""

    def __init__(self, model: TableModel) -> None:
        self.model = model

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> pd.DataFrame:
        """Bad input (an unseen category, a missing column) is MLflow's INVALID_PARAMETER_VALUE
        with enn's one line: HTTP 400 from `mlflow models serve`, not a stack trace."""
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        try:
            return self.model.predict(frame)
        except DataError as e:
            raise MlflowException(str(e), error_code=INVALID_PARAMETER_VALUE) from None


def _load_pyfunc(data_path: str) -> EnnPyfunc:
    """MLflow's entry point for a `loader_module` flavor."""
    return EnnPyfunc(TableModel.load(data_path))


def signature_and_example(model: TableModel, features: Any) -> tuple[ModelSignature, pd.DataFrame]:
    """The signature (named, typed input columns; named double outputs) and an input example
    (the first staged rows of `features`, in those types: text categories as the source spells
    them, whole-number categories as numbers)."""
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import ColSpec, Schema

    inputs = Schema([ColSpec(kind, name) for name, kind in model.input_columns])
    outputs = Schema([ColSpec("double", name) for name in model.output_columns])
    example = typed(decode(features[:EXAMPLE_ROWS], model.specs), model.specs)
    return ModelSignature(inputs=inputs, outputs=outputs), example


def requirements() -> list[str]:
    """What the model's environment needs (with `--env-manager local`, the project's own)."""
    out = []
    for dist in ("enn-pipeline", "torch", "numpy", "pandas", "onnx", "onnxruntime"):
        try:
            out.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


class Flavor:
    """A flavor module for `mlflow.models.Model.log`: the pyfunc flavor through this loader
    module, with the `onnx` flavor beside it pointing at the same folder's model.onnx."""

    __name__ = "enn"

    @staticmethod
    def save_model(path: str, mlflow_model: Model, bundle: Path, **kwargs: Any) -> None:
        import mlflow.pyfunc

        if (bundle / ONNX_FILE).is_file():
            mlflow_model.add_flavor(
                "onnx",
                onnx_version=importlib.metadata.version("onnx"),
                data=f"data/{DATA_DIR}/{ONNX_FILE}",
                providers=["CPUExecutionProvider"],
                code=None,
            )
        mlflow.pyfunc.save_model(
            path,
            loader_module=LOADER_MODULE,
            data_path=str(bundle),
            mlflow_model=mlflow_model,
            pip_requirements=requirements(),
            **kwargs,
        )
