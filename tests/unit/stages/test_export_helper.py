"""export in its helper process (enn_core.export_helper), as the training flow runs it: the
helper starts before the stage, imports the exporters, and makes the same programs the stage
makes in its own process; its errors are the stage's, with their class; a cancelled or unused
helper is gone."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import threading

import pytest

from enn_core import export_helper
from enn_core.config import ExportConfig, to_plain
from enn_core.errors import ExportError, StaleOutputError
from enn_core.runtime import children
from enn_core.runtime.parent import PARENT_ENV
from enn_core.stages import COLLAPSE_CHECK, EXPORT
from tests.fixtures.project import ROOT
from tests.unit.runtime.test_children import environ
from tests.unit.stages.test_evaluation_stages import _ctx, _project

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
PT2 = ExportConfig(formats=("torch_export",), required=("torch_export",))
BOTH = ExportConfig()  # torch_export here, onnx in the helper


def _run(helper, request, say, cancel):
    """A request as the stage makes it (enn_core.export.programs): sent, then answered."""
    return export_helper.answer(export_helper.send(helper, request), say, cancel)


@pytest.fixture(autouse=True)
def _no_helper_left():
    yield
    export_helper.release_unused()


def _trained(tmp_path, export=PT2):
    cfg = dataclasses.replace(_project(tmp_path, steps=150), export=export)
    COLLAPSE_CHECK.work(cfg, _ctx(cfg, tmp_path, COLLAPSE_CHECK))
    return cfg


def test_the_helper_is_started_with_the_parent_handshake_as_a_child_of_the_table():
    """Like every process a job starts, it names its parent (ENN_PARENT_PID): one whose
    parent dies while it imports ends at once, not after seconds of imports under init."""
    helper = export_helper.start(PT2.formats)
    assert f"{PARENT_ENV}={os.getpid()}".encode() in environ(helper.proc.pid)
    assert helper.child in children.running() and helper.child.kind == "export-helper"
    export_helper.release_unused()
    assert helper.proc.poll() is not None and helper.child not in children.running()


@pytest.mark.parametrize("export", [PT2, BOTH], ids=["one-format", "two-formats"])
def test_the_helper_makes_the_programs_the_stage_makes_here(tmp_path, caplog, export):
    cfg = _trained(tmp_path, export)
    out = tmp_path / "outputs" / "export"
    EXPORT.work(cfg, _ctx(cfg, tmp_path, EXPORT))  # no helper: in this process
    here = json.loads((out / "parity.json").read_text())
    sidecar = json.loads((out / "sidecar.json").read_text())
    shutil.rmtree(tmp_path / "work" / "cache" / "export")
    helper = export_helper.start(cfg.export.formats)
    with caplog.at_level(logging.INFO, logger="enn"):
        EXPORT.work(cfg, _ctx(cfg, tmp_path, EXPORT))
    assert helper.proc.poll() is not None, "the helper answered and is gone"
    # its lines reach the stage's log as it works; its own output went to its log file
    assert "export: tracing the prediction path" in caplog.text
    assert "export: model.pt2: writing it, then parity on 40 of 40 held-out rows" in caplog.text
    assert ("model.onnx: writing it" in caplog.text) == ("onnx" in export.formats)
    log = tmp_path / "work" / "runs" / "test" / "export" / "logs" / "export-helper.log"
    assert log.is_file()
    assert json.loads((out / "parity.json").read_text()) == here
    again = json.loads((out / "sidecar.json").read_text())
    assert again["formats"] == sidecar["formats"]  # the same program bytes (sha256)
    assert set(again["formats"]) == set(export.formats)


def test_its_errors_are_the_stages_with_their_class_and_an_unused_helper_is_gone(tmp_path):
    cfg = dataclasses.replace(_project(tmp_path, steps=1), export=PT2)
    helper = export_helper.start(cfg.export.formats)
    assert export_helper.take() is helper
    request = {
        "config": to_plain(cfg),
        "root": str(tmp_path),
        "stage": "export",
        "inputs": [str(tmp_path / "outputs" / d) for d in ("stage-data", "distributed-train")]
        + [str(tmp_path / "nowhere")],  # no calibration: collapse-check never ran
        "out": str(tmp_path / "out"),
        "log": str(tmp_path / "helper.log"),
    }
    with pytest.raises(StaleOutputError, match="collapse-check"):
        _run(helper, request, lambda line: None, None)
    assert helper.proc.poll() is not None

    # killed before its request: one line that names its log, not a broken pipe
    helper = export_helper.start(cfg.export.formats)
    helper.proc.kill()
    helper.proc.wait()
    with pytest.raises(ExportError, match=r"helper process ended \(exit -9\).*helper.log"):
        _run(helper, request, lambda line: None, None)
    ended = export_helper.start(cfg.export.formats).proc
    ended.kill()
    ended.wait()
    assert export_helper.take() is None  # an ended helper is not taken: export runs here

    # cancelled while it works: stopped at once
    helper = export_helper.start(cfg.export.formats)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(ExportError, match="cancelled"):
        _run(export_helper.take() or helper, request, lambda line: None, cancel)
    assert helper.proc.poll() is not None

    # started and never taken: the session's end stops it
    helper = export_helper.start(cfg.export.formats)
    export_helper.release_unused()
    assert helper.proc.poll() is not None and export_helper.take() is None


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_that_reaches_the_helper_stops_the_stage_as_interrupted(tmp_path, signum):
    """Ctrl-C (or a scheduler's SIGTERM) reaches the whole group; this process's own
    KeyboardInterrupt can be lost (raised inside a finalizer while torch traces, Python only
    prints it), so the helper's counts."""
    cfg = _trained(tmp_path)
    helper = export_helper.start(cfg.export.formats)
    request = {
        "config": to_plain(cfg),
        "root": str(tmp_path),
        "stage": "export",
        "inputs": [
            str(tmp_path / "outputs" / d)
            for d in ("stage-data", "distributed-train", "collapse-check")
        ],
        "out": str(tmp_path / "out"),
        "log": str(tmp_path / "helper.log"),
    }
    (tmp_path / "out").mkdir()

    def interrupt(line: str) -> None:  # its first line: it works on the request now
        if helper.proc.poll() is None:
            os.kill(helper.proc.pid, signum)

    with pytest.raises(KeyboardInterrupt):
        _run(helper, request, interrupt, None)
    assert helper.proc.poll() is not None
    assert "KeyboardInterrupt" not in (tmp_path / "helper.log").read_text()  # no traceback


def _bare(tmp_path, code: list[str]) -> export_helper.Helper:
    return export_helper.Helper(
        children.start("export-helper", [sys.executable, *code], pipes=True, cwd=ROOT)
    )


def test_a_failed_warm_up_import_is_not_the_requests_error_and_odd_answers_are_one_line(
    tmp_path,
):
    """A module the warm-up could not import (an optional ONNX package not installed) is left
    to export's own rules; an answer that is not one of the helper's messages is one
    ExportError naming its log, not a traceback."""
    cfg = dataclasses.replace(_project(tmp_path, steps=1), export=PT2)
    request = {
        "config": to_plain(cfg),
        "formats": ["torch_export"],
        "root": str(tmp_path),
        "stage": "export",
        "inputs": [str(tmp_path / "outputs" / "stage-data"), str(tmp_path / "nowhere")] * 2,
        "out": str(tmp_path / "out"),
        "log": str(tmp_path / "helper.log"),
    }
    request["inputs"] = request["inputs"][:3]
    helper = _bare(tmp_path, ["-m", "enn_core.export_serve", "no_such_module_at_all"])
    with pytest.raises(StaleOutputError):  # it served the request: the inputs' own error
        _run(helper, request, lambda line: None, None)
    assert "warm-up import failed" in (tmp_path / "helper.log").read_text()

    for answer in ("not json", '{"what": 1}', '{"results": [1]}', "[]"):
        code = f"import sys; sys.stdin.readline(); print({answer!r}, flush=True)"
        helper = _bare(tmp_path, ["-c", code])
        with pytest.raises(ExportError, match=r"not one of its messages; see .*helper\.log"):
            _run(helper, request, lambda line: None, None)
        assert helper.proc.poll() is not None
