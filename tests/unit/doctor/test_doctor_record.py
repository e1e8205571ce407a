"""The diagnostics record of a run directory names each symptom: the non-finite tensor and
step, the out-of-memory back-off, the hung rank's phase, the bottleneck, the attention backend.

These tests write the run directory with the runtime's own writers (EventLog, Heartbeat,
write_error, telemetry.write_epoch); real training with injected faults (NaN in a batch,
out-of-memory): tests/distributed/test_doctor.py."""

from __future__ import annotations

import json

from enn_core.diagnostics import diagnostics, markdown, write
from enn_core.events import EventLog
from enn_core.runtime.heartbeat import Heartbeat
from enn_core.runtime.launch import write_error
from enn_core.telemetry import bottleneck_verdict, write_epoch


def test_record_gathers_what_the_runtime_wrote(tmp_path):
    events = EventLog(tmp_path)
    events.param("runtime.attention", "math")
    events.param("runtime.attention_reason", "train.attention=math (probe passed)")
    events.param("runtime.attention_probes", json.dumps({"math": {"ok": True}}))
    events.event(
        "nonfinite_skip", epoch=0, step=3, tensor="batch.features[micro 0]", rank=1, consecutive=1
    )
    events.event(
        "oom_backoff",
        epoch=0,
        step=4,
        micro_batch_before=8,
        micro_batch_after=4,
        accumulation_after=2,
        reason="injected out-of-memory",
    )
    write_epoch(events, 0, bottleneck_verdict({"data": 9.0, "compute": 0.5, "optimizer": 0.1}))
    hb = Heartbeat(tmp_path, rank=1).start()
    hb.phase("first_forward", 0)  # rank 1 stays there: what a hung rank leaves behind
    write_error(tmp_path, 0, TimeoutError("gloo timed out"), "step", 5, "trace")
    try:
        diag = diagnostics(tmp_path)
    finally:
        hb.stop()
    assert diag["choices"]["attention"] == "math" and diag["choices"]["attention_probes"] == {
        "math": {"ok": True}
    }
    assert (
        diag["nonfinite"][0]["tensor"] == "batch.features[micro 0]"
        and diag["nonfinite"][0]["step"] == 3
    )
    assert diag["oom_backoffs"][0]["micro_batch_after"] == 4
    assert diag["bottleneck"][0]["verdict"] == "data-bound"
    assert diag["workers"]["1"]["phase"] == "first_forward"
    assert diag["errors"][0]["phase"] == "step" and diag["errors"][0]["type"] == "TimeoutError"
    md = markdown(diag)
    assert "non-finite batch.features[micro 0] at step 3 on rank 1" in md
    assert "micro-batch 8 -> 4" in md and "| 0 | data-bound |" in md
    assert "attention backend math" in md and "| 1 | first_forward | 0 | 0 |" in md
    assert json.loads(write(tmp_path, diag).read_text())["nonfinite"][0]["rank"] == 1


def test_empty_run_dir_gives_an_empty_record(tmp_path):
    diag = diagnostics(tmp_path)
    assert diag["errors"] == [] and diag["bottleneck"] == [] and diag["workers"] == {}
    assert "nothing to report" in markdown(diag)
