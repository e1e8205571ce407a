"""`enn run`'s closing summary (flows/summary.py `Summary`): each stage's line, also when the flow
failed or was stopped (the stage it stopped, the stages that did not run), the log file, and
the run's own MLflow and Prefect pages when a UI serves them (else how to start one)."""

from __future__ import annotations

import http.server
import json
import os
import re
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from enn_core.config import RunConfig
from enn_core.paths import Layout
from flows import console
from flows.summary import Summary
from tasks.runner import FlowRecord, StageResult


def _result(stage: str, status: str = "ran", seconds: float = 1.25) -> StageResult:
    reason = "executed" if status == "ran" else "up to date (dvc status)"
    return StageResult(stage, status, reason, None, "", None, seconds, seconds)  # type: ignore[arg-type]


@pytest.fixture
def layout(tmp_path, monkeypatch) -> Layout:
    monkeypatch.setattr(console, "LOG_FILE", tmp_path / "work" / "logs" / "1-run-training.log")
    out = Layout.for_root(tmp_path, "work")
    out.work.mkdir(parents=True)
    return out


def test_a_finished_run_lists_each_stage_and_where_to_look(layout):
    record = FlowRecord(flow_run_id="7e1d")
    record.results["stage-data"] = _result("stage-data", "skipped", 0.0)
    record.results["prepare-checkpoint"] = _result("prepare-checkpoint", seconds=0.31)
    lines = Summary(layout, RunConfig(), "training", "prepare-checkpoint", "http://127.0.0.1:9/api")
    assert lines.lines(record) == [
        "stage-data           skipped      0.0 s  up to date (dvc status)",
        "prepare-checkpoint   ran          0.3 s  executed",
        f"outputs: {layout.outputs}/<stage>/ (staged data: {layout.outputs / 'stage-data'})",
        f"log: {console.LOG_FILE}",
        "look: enn ui (MLflow and Prefect), dvc metrics show",  # no UI answers
    ]


@pytest.mark.parametrize("ended", ["failed", "interrupted", "cancelled"])
def test_a_stopped_run_says_which_stage_stopped_and_what_did_not_run(layout, ended):
    record = FlowRecord(flow_run_id="7e1d")
    record.results["stage-data"] = _result("stage-data")
    record.results["prepare-checkpoint"] = _result("prepare-checkpoint")
    record.running, record.running_since = "distributed-train", time.monotonic() - 12.0
    lines = Summary(layout, RunConfig(), "training", None, "http://127.0.0.1:9/api").lines(
        record, ended
    )
    assert lines[:2] == [
        "stage-data           ran          1.2 s  executed",
        "prepare-checkpoint   ran          1.2 s  executed",
    ]
    assert re.fullmatch(rf"distributed-train +{ended} +1[23]\.\d s", lines[2]), lines[2]
    assert lines[3:] == [
        "validate             not run",
        "predict              not run",
        "collapse-check       not run",
        "export               not run",
        f"log: {console.LOG_FILE}",
        "look: enn ui (MLflow and Prefect), dvc metrics show",
    ]


def test_a_run_stopped_before_any_stage_names_only_its_log(layout):
    summary = Summary(layout, RunConfig(), "prediction", None, "http://127.0.0.1:9/api")
    assert summary.lines(FlowRecord(), "failed") == [f"log: {console.LOG_FILE}"]


class _UI(http.server.BaseHTTPRequestHandler):
    """Stands in for `enn ui`'s servers: every page answers 200 with HTML (its health too)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = b"<!doctype html><html></html>"
        self.send_response(200)
        self.send_header("content-type", "text/html; charset=utf-8")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def ui_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _UI)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_with_enn_ui_running_it_links_the_runs_own_pages(layout, ui_server):
    api = f"{ui_server}/api"
    # what `enn ui` writes while it runs (tasks/ui.py announce_ui); its pid must be alive
    started = psutil.Process().create_time()
    ui = {"pid": os.getpid(), "started": started, "prefect_api": api, "mlflow": ui_server}
    (layout.work / "ui.json").write_text(json.dumps(ui))
    record = FlowRecord(flow_run_id="0b6f", mlflow_experiment_id="1", mlflow_run_id="a1b2c3")
    record.results["stage-data"] = _result("stage-data")
    lines = Summary(layout, RunConfig(), "training", "stage-data", api).lines(record)
    assert lines[-3:] == [
        f"look: MLflow run {ui_server}/#/experiments/1/runs/a1b2c3?workflowType=machine_learning",
        f"look: Prefect flow run {ui_server}/runs/flow-run/0b6f",
        "look: dvc metrics show",
    ]
    # tracking off: no MLflow run to link; the Prefect page still
    record.mlflow_run_id = record.mlflow_experiment_id = None
    assert Summary(layout, RunConfig(), "training", "stage-data", api).lines(record)[-3:] == [
        f"log: {console.LOG_FILE}",
        f"look: Prefect flow run {ui_server}/runs/flow-run/0b6f",
        "look: dvc metrics show",
    ]


def test_the_results_line_says_when_a_baseline_beat_the_model(layout):
    """Issue 32: on the workbook gbt scored 3.286 against the model's 3.334 on validation, and
    only validate's own line showed it."""
    metrics = {  # as validate writes them: sorted by name
        "test/gbt_mae": 3.8,
        "val/mae": 3.334,
        "val/naive_conditional_mae": 3.5,
        "val/naive_cell_mean_mae": 6.3,
        "val/ridge_mae": 3.4,
        "val/gbt_mae": 3.286,
        "test/mae": 3.1,
        "test/naive_conditional_mae": 3.6,
        "test/naive_cell_mean_mae": 6.9,
        "test/ridge_mae": 3.7,
    }
    out = layout.outputs / "validate"
    out.mkdir(parents=True)
    (out / "metrics.json").write_text(json.dumps(metrics))
    record = FlowRecord()
    record.results["validate"] = _result("validate")
    lines = Summary(layout, RunConfig(), "training", None, "http://127.0.0.1:9/api").lines(record)
    assert (
        "results: val MAE 3.334, beaten by gbt 3.286 (naive_conditional 3.500, ridge 3.400); "
        "test MAE 3.100"
    ) in lines  # every predictor named would be 141 columns: the test split's others go


def test_the_results_line_fits_120_columns_and_names_each_predictor_once():
    """Issue 39: the line was about 330 characters and said some things twice under two names
    ("conditional naive 5.25 ... naive_best 5.25", raw metric keys beside readable names)."""
    from flows.report import results_line

    m: dict[str, object] = {"naive_best": "naive_conditional"}
    for split, model in (("val", 2.041), ("test", 1.916)):
        m.update({f"{split}/mae": model, f"{split}/naive_best_mae": 5.25})
        for name, v in (
            ("naive_conditional", 5.25),
            ("naive_conditional_median", 5.31),
            ("naive_cell_mean", 5.503),
            ("naive_cell_median", 5.61),
            ("ridge", 2.093),
            ("gbt", 2.204),
        ):
            m[f"{split}/{name}_mae"] = v
    line = results_line(m)
    # every predictor named would be 136 characters: on the test split only those that beat
    # the model (MLflow and dvc metrics show hold every figure)
    assert line == (
        "results: val MAE 2.041 (naive_conditional 5.250, gbt 2.204, ridge 2.093); test MAE 1.916"
    ), line
    line = results_line({**m, "test/mae": 2.1})  # ridge beat it on test: named
    assert line == (
        "results: val MAE 2.041 (naive_conditional 5.250, gbt 2.204, ridge 2.093); "
        "test MAE 2.100, beaten by ridge 2.093"
    ), line
    one = {k: v for k, v in m.items() if not k.startswith("test/")}
    assert results_line(one) == (
        "results: val MAE 2.041 (naive_conditional 5.250, gbt 2.204, ridge 2.093)"
    ), results_line(one)
    worst = {k: (9.99999 if k.endswith("/mae") else v) for k, v in m.items()}  # every one beat it
    line = results_line(worst)
    assert line is not None and len(line) <= 120, (len(line or ""), line)
    assert "val MAE 10.00, beaten by ridge 2.093" in line and "(+" in line, line
    assert "naive_best" not in line and "conditional naive" not in line


def test_a_prediction_run_names_its_predictions_and_no_dvc_metrics(layout):
    out = layout.outputs / "collapse-check"
    out.mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps({"n_rows": 3}))
    for name in ("predictions.parquet", "predictions.npy"):
        (out / name).write_bytes(b"")
    record = FlowRecord()
    record.results["collapse-check"] = _result("collapse-check")
    lines = Summary(layout, RunConfig(), "prediction", None, "http://127.0.0.1:9/api").lines(record)
    assert (
        f"predictions: {out / 'predictions.parquet'} (3 rows; predictions.npy beside it)" in lines
    )
    assert lines[-1] == "look: enn ui (MLflow and Prefect)", lines


def test_a_node_tracking_to_servers_is_told_the_servers_not_enn_ui(layout):
    """A node whose run made no MLflow run of its own (a cluster node's step 1, up to date)
    but tracks to a server: `enn ui` would show an empty local store; the line names the
    tracking server instead (issue 54.8), its address without credentials."""
    from dataclasses import replace

    cfg = RunConfig()
    cfg = replace(cfg, tracking=replace(cfg.tracking, uri="http://node3:5001/"))
    record = FlowRecord(flow_run_id="7e1d")
    record.results["stage-data"] = _result("stage-data", "skipped", 0.0)
    # node3 does not resolve here: its Prefect UI is not named, its MLflow server is
    lines = Summary(layout, cfg, "prediction", None, "http://node3.invalid:9/api").lines(record)
    assert lines[-1] == "look: MLflow http://node3:5001", lines


def test_the_model_line_wraps_within_120_columns(layout):
    """The champion rule's reason made the `model:` line about 150 characters, which wrapped
    mid-word in a 120-column terminal; it now wraps at words, later lines indented."""
    from dataclasses import replace

    from tasks.tracking.registry import Registration

    why = (
        "val/mae 2.802 is not clearly below ridge 2.111 (bound +0.0123), gbt 2.202 (bound "
        "+0.0456) on 64 validation rows (the champion rule, a paired bootstrap: docs/serving.md)"
    )
    reg = Registration("enn-synthetic", True, why, version=3)
    record = FlowRecord()
    record.results["export"] = replace(_result("export"), registry=reg)
    lines = Summary(layout, RunConfig(), "training", None, "http://127.0.0.1:9/api").lines(record)
    at = next(i for i, line in enumerate(lines) if line.startswith("model: "))
    model = [lines[at]] + [line for line in lines[at + 1 :] if line.startswith("  ")]
    assert len(model) == 2 and all(len(line) <= 120 for line in model), model
    assert model[0].startswith("model: enn-synthetic version 3: candidate (champion unchanged): ")
    assert " ".join(line.strip() for line in model) == f"model: {reg.line()}"
    assert reg.headline() == "enn-synthetic version 3: candidate (champion unchanged)"


def test_the_results_line_prints_only_metric_names_from_metrics_json():
    """metrics.json is a file: a key that is not a metric's name (a terminal escape sequence,
    a path) is not printed."""
    from flows.report import results_line

    line = results_line({"val/mae": 2.0, "val/gbt_mae": 2.5, "val/\x1b[2Jx_mae": 1.0})
    assert line == "results: val MAE 2.000 (gbt 2.500)", line
