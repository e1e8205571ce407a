"""`enn run`'s closing summary: each stage's status and time, the results, the registered
version, and where to look."""

from __future__ import annotations

import json
import textwrap
import time
from typing import TYPE_CHECKING

from enn_core.config import RunConfig, redact_url
from enn_core.errors import EnnError
from enn_core.paths import Layout
from enn_core.stages import STAGE_DATA, VALIDATE, Flow, up_to
from flows import console
from flows.prefect_api import shared_api
from flows.report import RESULTS_WIDTH, predictions_lines, results_line

if TYPE_CHECKING:
    from tasks.runner import FlowRecord


def left_to_rank0_node(record: FlowRecord) -> bool:
    """Whether this node of a multi-node run stopped its flow early: the node of global rank 0
    runs the rest and publishes (flows.training.after_multinode)."""
    return any(r.summary is not None and r.summary.node_only for r in record.results.values())


class Summary:
    """How a flow run went: each stage's status and time, the headline results against the naive
    predictors, the registered version and the champion decision, and where to look (the run's
    MLflow and Prefect pages when a UI serves them, the log file, the outputs)."""

    def __init__(
        self, layout: Layout, cfg: RunConfig, flow: Flow, until: str | None, prefect_api: str
    ) -> None:
        self.layout, self.cfg, self.flow, self.until = layout, cfg, flow, until
        self.prefect_api = prefect_api

    def print(self, record: FlowRecord, ended: str | None = None) -> None:
        for line in self.lines(record, ended):
            print(line, flush=True)

    def lines(self, record: FlowRecord, ended: str | None = None) -> list[str]:
        log = [f"log: {console.LOG_FILE}"] if console.LOG_FILE is not None else []
        if ended is not None and not record.results and record.running is None:
            return log  # stopped before any stage (a config error): its one line says it
        out = self.stage_lines(record, ended)
        out += [record.params] if record.params else []
        if ended is None:
            out += self.result_lines(record)
            out.append(
                f"outputs: {self.layout.outputs}/<stage>/ "
                f"(staged data: {self.layout.outputs / STAGE_DATA.name})"
            )
        return out + log + self.look_lines(record)

    def stage_lines(self, record: FlowRecord, ended: str | None) -> list[str]:
        """`validate   ran   0.7 s  executed`; a stopped run adds the stage it stopped (its
        status: failed, cancelled, interrupted, terminated) and the stages that did not run."""
        out = [
            f"{s:20s} {r.status:8s} {r.seconds:7.1f} s  {r.reason}"
            for s, r in record.results.items()
        ]
        if ended is None:
            return out + self.elsewhere_lines(record)
        if record.running is not None:
            took = time.monotonic() - record.running_since
            out.append(f"{record.running:20s} {ended:8s} {took:7.1f} s")
        try:
            planned = [s.name for s in up_to(self.flow, self.until)]
        except EnnError:
            planned = []
        done = {*record.results, record.running}
        out += [f"{name:20s} not run" for name in planned if name not in done]
        return out

    def elsewhere_lines(self, record: FlowRecord) -> list[str]:
        """On a node of a multi-node run without global rank 0: the stages it left to that
        node (flows.training.after_multinode stopped the flow here)."""
        if not left_to_rank0_node(record):
            return []
        planned = [s.name for s in up_to(self.flow, self.until)]
        return [
            f"{name:20s} not run  (the node of global rank 0 runs it)"
            for name in planned
            if name not in record.results
        ]

    def result_lines(self, record: FlowRecord) -> list[str]:
        out = []
        metrics = VALIDATE.output_dir(self.layout) / "metrics.json"
        if self.flow == "training" and VALIDATE.name in record.results and metrics.is_file():
            m = json.loads(metrics.read_text())
            line = results_line(m)
            out += [line] if line else []
        for r in record.results.values():
            if r.registry:  # the reason can be 150 characters: wrapped at the terminal's 120
                out += textwrap.wrap(
                    f"model: {r.registry.line()}",
                    width=RESULTS_WIDTH,
                    subsequent_indent="  ",
                    break_long_words=False,
                    break_on_hyphens=False,
                )
        if self.flow == "prediction":
            out += predictions_lines(self.layout)
        return out

    def look_lines(self, record: FlowRecord) -> list[str]:
        """The run's pages where a UI serves them; else how to start one."""
        from tasks.ui import mlflow_run_url, mlflow_ui

        out = []
        mlflow = mlflow_ui(self.cfg, self.layout.work) if record.mlflow_run_id else None
        if mlflow and record.mlflow_experiment_id and record.mlflow_run_id:
            url = mlflow_run_url(mlflow, record.mlflow_experiment_id, record.mlflow_run_id)
            out.append(f"look: MLflow run {redact_url(url)}")
        prefect = prefect_ui(self.prefect_api) if record.flow_run_id else None
        if prefect:
            shown = redact_url(prefect)
            out.append(f"look: Prefect flow run {shown}/runs/flow-run/{record.flow_run_id}")
        hints = [] if out else self.servers()
        if self.flow == "training":  # the prediction pipeline publishes no DVC metrics
            hints.append("dvc metrics show")
        return out + ([f"look: {', '.join(hints)}"] if hints else [])

    def servers(self) -> list[str]:
        """Where this run's records are when no run page is known: the tracking server and
        Prefect's server the run reports to (a node of a cluster), else `enn ui`, which serves
        this checkout's own stores."""
        found = []
        if self.cfg.tracking.uri.startswith(("http://", "https://")):
            found.append(f"MLflow {redact_url(self.cfg.tracking.uri.rstrip('/'))}")
        prefect = prefect_ui(self.prefect_api) if shared_api(self.prefect_api) else None
        if prefect:
            found.append(f"Prefect {redact_url(prefect)}")
        return found or ["enn ui (MLflow and Prefect)"]


def prefect_ui(api: str) -> str | None:
    """The Prefect UI at the API's server (its root, where `prefect server start` serves it),
    or None: enn run's temporary API serves no UI (PREFECT_UI_ENABLED=0)."""
    import urllib.request

    base = api.rstrip("/").removesuffix("/api")
    try:
        with urllib.request.urlopen(f"{base}/", timeout=3) as r:  # noqa: S310 - the run's API
            html = r.status == 200 and "html" in r.headers.get("content-type", "")
    except (OSError, ValueError):
        return None
    return base if html else None
