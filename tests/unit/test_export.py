"""export: parity of torch.export and ONNX (onnxruntime) with eager, the sidecar, and failures
that name the format, the operator or constraint, and the fix."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from enn_core import export as export_mod
from enn_core.collapse.measures import fit_affine
from enn_core.config import ExportConfig
from enn_core.errors import ConfigError, ExportError
from enn_core.inference import Calibration, PredictionPath
from tests.fixtures.evaluate import BatchBroadcast, Compressed, Generator, check_rows, dataset
from tests.fixtures.project import ROOT

pytestmark = pytest.mark.timeout(120)


@torch.library.custom_op("enntest::twist", mutates_args=())
def twist(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twist.register_fake
def _(x):
    return torch.empty_like(x)


class UnsupportedOp(Generator):
    """An operator torch.export keeps but ONNX has no translation for."""

    def predict(self, x):
        return twist(super().predict(x))


class FixedBatch(Generator):
    def predict(self, x):
        return super().predict(x).reshape(8, -1).reshape(8, *self.base.shape)


class Branchy(Generator):
    def predict(self, x):
        y = super().predict(x)
        if y.sum() > 0:
            return y
        return -y


class Drifting(Generator):
    """Eager output drifts with each call; the exported graph froze the value at trace time."""

    calls = 0

    def predict(self, x):
        Drifting.calls += 1
        return super().predict(x) + float(Drifting.calls)


def _heldout() -> np.ndarray:
    return dataset()[0][:30]


@pytest.mark.slow
def test_export_both_formats_with_parity_and_sidecar(tmp_path, capfd):
    rows = check_rows()
    with torch.no_grad():
        raw = Compressed().predict(torch.from_numpy(rows.features)).numpy()
    slope, intercept = fit_affine(raw, rows.target, 3.0)
    cal = Calibration("calibrated", "fp32", slope, intercept)
    path = PredictionPath(Compressed(), cal)
    cfg = ExportConfig(units="km/h")
    results = export_mod.export_all(path, _heldout(), tmp_path, cfg, label_std=rows.label_std)
    for fmt in ("torch_export", "onnx"):
        p = results[fmt]["parity"]
        assert results[fmt]["status"] == "ok" and p["ok"] and p["worst"] <= p["tolerance"]
        assert set(p["max_abs_diff"]) == {"1", "37", "64"} and p["rows"] == 30
    # `enn export` under `dvc repro` printed six "[torch.onnx] Run decompositions..." lines
    assert "[torch.onnx]" not in capfd.readouterr().out
    # the ONNX file answers in calibrated real units at a batch size never traced
    x = dataset()[0][:5]
    got = ort.InferenceSession(str(tmp_path / "model.onnx")).run(None, {"features": x})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, path(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-4)
    assert (
        onnx.load(str(tmp_path / "model.onnx"))
        .graph.input[0]
        .type.tensor_type.shape.dim[0]
        .dim_param
        == "batch"
    )
    pt2 = torch.export.load(str(tmp_path / "model.pt2")).module()
    np.testing.assert_allclose(pt2(torch.from_numpy(x)).numpy(), got, rtol=1e-5, atol=1e-4)

    data = {
        "feature_specs": [
            {
                "name": "month",
                "kind": "categorical",
                "vocab": [str(m) for m in range(6)],
                "cyclic_period": 6,
            },
            {"name": "daytype", "kind": "categorical", "vocab": ["a", "b", "c", "d"]},
            {"name": "direction", "kind": "categorical", "vocab": ["up", "down"]},
        ],
        "label_shape": [3, 4],
        "label_axes": ["section", "hour"],
        "label_axis_values": {"section": ["s0", "s1", "s2"], "hour": ["00", "01", "02", "03"]},
    }
    side = export_mod.build_sidecar(data, cal, cfg, results, {"data_fingerprint": "abc"}, "fp32")
    side = json.loads(json.dumps(side))  # it is plain JSON
    assert side["input"]["order"] == ["month", "daytype", "direction"] and side["input"][
        "shape"
    ] == ["batch", 3]
    assert (
        side["input"]["features"][2]["vocab"] == ["up", "down"]
        and side["input"]["features"][0]["kind"] == "categorical"
    )
    assert side["output"]["shape"] == ["batch", 3, 4] and side["output"]["axes"] == [
        "batch",
        "section",
        "hour",
    ]
    assert (
        side["output"]["units"] == "km/h"
        and side["opset"] == 18
        and side["data_fingerprint"] == "abc"
    )
    assert side["candidate"] == "calibrated" and side["calibration"].startswith("per-output affine")
    assert (
        side["versions"]["torch"] == torch.__version__
        and side["versions"]["onnxruntime"] == ort.__version__
    )
    assert (
        side["formats"]["onnx"]["sha256"] and side["formats"]["torch_export"]["file"] == "model.pt2"
    )


def test_per_sample_candidate_is_refused_naming_batch_dependence(tmp_path):
    path = PredictionPath(BatchBroadcast(), Calibration("per_sample"))
    with pytest.raises(ExportError, match="batch-dependent"):
        export_mod.export_all(path, _heldout(), tmp_path, ExportConfig(), label_std=5.0)
    with pytest.raises(
        ExportError, match=r"batch-dependent \(batched vs batch-size-1 outputs differ by 0.83"
    ):
        export_mod.refuse_batch_dependent(Calibration("per_sample"), 0.83)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_unsupported_operator_names_format_operator_and_fix(tmp_path):
    path = PredictionPath(UnsupportedOp(), Calibration())
    with pytest.raises(ExportError) as e:
        export_mod.export_all(path, _heldout(), tmp_path, ExportConfig(), label_std=5.0)
    msg = str(e.value)
    assert msg.startswith("export onnx: operator enntest.twist.default has no ONNX translation")
    assert "custom_translation_table" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "model, expected",
    [
        (
            FixedBatch(),
            r"export torch_export: dynamic-shape constraint on dimension 'batch' broke: "
            r".* fixes the batch size to 8.*x\.shape\[0\]",
        ),
        (
            Branchy(),
            r"export torch_export: data-dependent control flow at test_export\.py:\d+ "
            r"\(if y\.sum\(\) > 0:\).*torch\.where",
        ),
    ],
)
def test_torch_export_failures_name_the_constraint(tmp_path, model, expected):
    cfg = ExportConfig(formats=("torch_export",), required=("torch_export",))
    with pytest.raises(ExportError, match=expected):
        export_mod.export_all(
            PredictionPath(model, Calibration()), _heldout(), tmp_path, cfg, label_std=5.0
        )


def test_parity_failure_fails_the_export(tmp_path):
    cfg = ExportConfig(formats=("torch_export",), required=("torch_export",))
    with pytest.raises(
        ExportError, match=r"export torch_export: parity failed: max \|diff\| .* > "
    ):
        export_mod.export_all(
            PredictionPath(Drifting(), Calibration()), _heldout(), tmp_path, cfg, label_std=5.0
        )


def test_optional_format_skipped_only_for_missing_dependency(tmp_path, monkeypatch):
    monkeypatch.setitem(export_mod.DEPENDENCIES, "onnx", ("enn_no_such_module",))
    path = PredictionPath(Generator(), Calibration())
    optional = ExportConfig(formats=("torch_export", "onnx"), required=("torch_export",))
    results = export_mod.export_all(path, _heldout(), tmp_path, optional, label_std=5.0)
    assert results["torch_export"]["status"] == "ok"
    assert results["onnx"] == {
        "status": "skipped",
        "reason": "optional format; missing dependency ['enn_no_such_module']",
    }
    with pytest.raises(
        ExportError, match=r"export onnx: required format needs \['enn_no_such_module'\]"
    ):
        export_mod.export_all(path, _heldout(), tmp_path, ExportConfig(), label_std=5.0)


def test_a_ctrl_c_wrapped_in_another_error_stops_the_export_as_interrupted(monkeypatch):
    """Seen in a terminal: Ctrl-C while the tracer's first import made a class came back as
    `RuntimeError: Error calling __set_name__ ...` and failed the export (exit 7); it is an
    interrupt (exit 130). A plain tracer error stays one ExportError."""

    def wrapped(*args, **kwargs):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise RuntimeError("Error calling __set_name__ on 'Field' instance") from e

    monkeypatch.setattr(torch.export, "export", wrapped)
    example = torch.zeros(2, 3)
    with pytest.raises(KeyboardInterrupt):
        export_mod.export_torch(PredictionPath(FixedBatch(), Calibration()), example)

    def broken(*args, **kwargs):
        raise RuntimeError("a tracer error")

    monkeypatch.setattr(torch.export, "export", broken)
    with pytest.raises(ExportError, match="a tracer error"):
        export_mod.export_torch(PredictionPath(FixedBatch(), Calibration()), example)


# export as the flow runs it: this process, SIGTERM taken as Ctrl-C (flows/exits.py)
SIGNALLED = """
import sys
from enn_core.config import ExportConfig
from enn_core.export import export_all
from enn_core.inference import Calibration, PredictionPath
from flows.exits import sigterm_as_interrupt
from tests.fixtures.evaluate import Generator, dataset

with sigterm_as_interrupt():
    try:
        export_all(PredictionPath(Generator(), Calibration()), dataset()[0][:30], sys.argv[1],
                   ExportConfig(), 5.0, say=lambda line: print(line, flush=True))
    except KeyboardInterrupt as e:
        print("stopped:", type(e).__name__, flush=True)
        sys.exit(130)
print("finished", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_while_export_traces_stops_it_as_interrupted(tmp_path, signum):
    """Ctrl-C (or a scheduler's SIGTERM) while torch traces and converts ends the export as an
    interrupt (the stage then stops as interrupted or terminated, exit 130 or 143), never as
    a failed export (exit 7, an export-failure.json). In a fresh interpreter: the signal
    lands in the tracer's first imports, where it was once wrapped in another error."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGNALLED, str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first.startswith("tracing the prediction path"), first
    proc.send_signal(signum)
    rest = proc.stdout.read()
    assert proc.wait(timeout=60) == 130, first + rest
    stopped = "Terminated" if signum == signal.SIGTERM else "KeyboardInterrupt"
    assert f"stopped: {stopped}" in rest and "finished" not in rest, rest


def test_a_cached_record_naming_another_path_is_ignored(tmp_path):
    """work/cache/export/<key>/results.json is data: a record whose file leads out of the cache
    (or names any file but the two programs) is no hit, and nothing is copied anywhere."""
    import hashlib
    import json

    from enn_core import export_cache

    cache, out = tmp_path / "cache", tmp_path / "a" / "out"
    cache.mkdir()
    out.mkdir(parents=True)
    secret = tmp_path / "secret.txt"
    secret.write_text("not a program")
    digest = hashlib.sha256(secret.read_bytes()).hexdigest()
    for name in ("../secret.txt", "sidecar.json"):
        record = {"onnx": {"status": "ok", "file": name, "sha256": digest}}
        (cache / "results.json").write_text(json.dumps(record))
        assert export_cache.load(cache, out) is None, name
        assert list(out.iterdir()) == [] and not (tmp_path / "a" / "secret.txt").exists()


def test_parity_runs_on_a_fixed_sample_of_at_most_parity_rows_held_out_rows():
    """At 10^7 rows the held-out rows are 3 x 10^6: parity at batch 1 on each of them took
    hours. It runs on a seeded sample, spread over validation and test, the same every run."""
    val, test = np.arange(0, 1_500_000, 2), np.arange(2_000_000, 3_500_000, 2)
    heldout = np.concatenate([val, test])
    sample = export_mod.parity_sample(heldout, 4096)
    assert len(sample) == 4096 and len(np.unique(sample)) == 4096
    assert np.all(np.diff(sample) > 0) and np.isin(sample, heldout).all()
    assert 1500 < np.isin(sample, val).sum() < 2600 and 1500 < np.isin(sample, test).sum() < 2600
    np.testing.assert_array_equal(sample, export_mod.parity_sample(heldout, 4096))
    np.testing.assert_array_equal(export_mod.parity_sample(val[:100], 4096), val[:100])
    with pytest.raises(ConfigError, match=r"export\.parity_rows must be >= 1"):
        ExportConfig(parity_rows=0)


def test_parity_says_how_many_of_the_held_out_rows_it_ran_on(tmp_path):
    cfg = ExportConfig(formats=("torch_export",), required=("torch_export",))
    lines: list[str] = []
    results = export_mod.export_all(
        PredictionPath(Generator(), Calibration()),
        _heldout(),
        tmp_path,
        cfg,
        label_std=5.0,
        say=lines.append,
        heldout_rows=3_000_000,
    )
    parity = results["torch_export"]["parity"]
    assert parity["ok"] and parity["rows"] == 30 and parity["heldout_rows"] == 3_000_000
    assert any("parity on 30 of 3,000,000 held-out rows at batch 1, 37, 64" in ln for ln in lines)
