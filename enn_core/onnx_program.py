"""The ONNX program as files and as a runner: what export writes and serving runs.

`model.onnx` holds the graph; past `export.onnx_external_data_mb` its weights are in
`model.onnx.data` beside it, which model.onnx names by that relative path: every copy of the
program (export's cache, the registry's bundle, a node's copy) carries `onnx_files(target)`,
and onnxruntime refuses model.onnx without them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

INPUT_NAME, OUTPUT_NAME = "features", "prediction"
# the ONNX program's weights when they are written beside it: the name torch.onnx gives them
ONNX_DATA = "model.onnx.data"
# An exported artifact as parity runs it: a float32 batch of raw features in, its outputs out.
Runner = Callable[[np.ndarray], np.ndarray]


def onnx_files(target: Path) -> list[Path]:
    """`target` (model.onnx) and its external data file when it has one: what a copy of the
    ONNX program must carry (onnxruntime refuses model.onnx without it)."""
    data = target.with_name(ONNX_DATA)
    return [target, data] if data.is_file() else [target]


def name_batch_axis(target: Path) -> None:
    """The exporter names the dynamic batch after an internal symbol; call it 'batch'."""
    import onnx  # optional dependency: only the onnx format needs it

    model = onnx.load(str(target), load_external_data=False)  # large weights stay where they are
    for vi in [*model.graph.input, *model.graph.output]:
        dim0 = vi.type.tensor_type.shape.dim[0]
        if dim0.dim_param:
            dim0.dim_param = "batch"
    onnx.save(model, str(target))


def ort_runner(target: Path) -> Runner:
    """`model.onnx` under onnxruntime on CPU: a float32 batch in, the program's output out."""
    import onnxruntime as ort  # only when the onnx format is exported (optional dependency)

    sess = ort.InferenceSession(str(target), providers=["CPUExecutionProvider"])
    return lambda xb: sess.run(None, {INPUT_NAME: xb})[0]
