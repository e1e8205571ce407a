"""Export layer: a module with data-dependent control flow fails naming the line and the fix;
--quick skips the export; the ONNX line reports its dependencies."""

from __future__ import annotations

import numpy as np
import torch

from enn_core.doctor import export
from enn_core.doctor.report import Recorder
from tests.fixtures.doctor import context


class DataDependent(torch.nn.Module):
    """Branches on a tensor value: not exportable with torch.export."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


def test_data_dependent_flow_fails_with_the_cause():
    rec = Recorder("export")
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    export.export_parity(rec, DataDependent(), rows, label_std=1.0, rel_tol=1e-4)
    check = rec.checks[0]
    assert check.status == "fail"
    assert "data-dependent control flow" in check.detail and "torch.where" in check.detail


def test_quick_skips_export_and_reports_onnx_dependencies(layout):
    checks = {c.name: c for c in export.run(context(layout, quick=True))}
    assert checks["torch.export"].status == "skip" and "--quick" in checks["torch.export"].detail
    assert checks["onnx"].status == "ok" and "onnxruntime" in checks["onnx"].detail
