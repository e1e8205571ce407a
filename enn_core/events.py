"""Metrics and events written to a run directory; the task layer forwards them to MLflow.

enn_core never imports mlflow. A stage (or rank 0 of a distributed job) appends JSON lines to
`<run_dir>/events.jsonl`:

    {"type": "metric", "name": "train/loss", "value": 0.12, "step": 3, "time": ...}
    {"type": "param",  "name": "resolved.train.precision", "value": "fp32"}
    {"type": "event",  "name": "oom_backoff", "fields": {...}}
    {"type": "artifact", "path": "/abs/path", "artifact_path": "plots"}
    {"type": "table", "name": "candidates", "rows": [{...}, ...]}

Lines are flushed as written, so a reader can follow a live job.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from enn_core.metric_names import resolved

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Append-only events file. `enabled=False` (ranks other than 0) makes every call a no-op."""

    def __init__(self, run_dir: str | Path | None, *, enabled: bool = True) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.enabled = enabled and self.run_dir is not None
        self._lock = threading.Lock()
        if self.enabled and self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.path = self.run_dir / EVENTS_FILE

    def _write(self, record: dict[str, Any]) -> None:
        self._write_all([record])

    def _write_all(self, records: list[dict[str, Any]]) -> None:
        """The records' lines in one append (one open of the file, not one per line)."""
        if not self.enabled or not records:
            return
        now = time.time()
        lines = "".join(
            json.dumps({**r, "time": r.get("time", now)}, default=_default, allow_nan=True) + "\n"
            for r in records
        )
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(lines)

    def metric(self, name: str, value: float, step: int | None = None) -> None:
        self._write({"type": "metric", "name": name, "value": float(value), "step": step})

    def metric_rows(self, rows: Sequence[tuple[str, float, int | None]]) -> None:
        """(name, value, step) metrics in one append: the training loop's buffered telemetry."""
        self._write_all(
            [{"type": "metric", "name": n, "value": float(v), "step": s} for n, v, s in rows]
        )

    def metrics(self, values: dict[str, float], step: int | None = None) -> None:
        for k, v in values.items():
            self.metric(k, v, step)

    def param(self, name: str, value: Any) -> None:
        """A value the stage chose at run time: MLflow parameter `resolved.<name>`, where
        `name` is dotted like the params.yaml key it resolves (`runtime.world_size`)."""
        self._write({"type": "param", "name": resolved(name), "value": value})

    def event(self, name: str, **fields: Any) -> None:
        self._write({"type": "event", "name": name, "fields": fields})

    def table(self, name: str, rows: list[dict[str, Any]]) -> None:
        """A table for the run's diagnostics record (and its Prefect table artifact)."""
        self._write({"type": "table", "name": name, "rows": rows})

    def artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._write(
            {"type": "artifact", "path": str(Path(path).resolve()), "artifact_path": artifact_path}
        )


def _default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    return str(o)


class EventTail:
    """Follows an events file while its job writes it: `new()` returns the records of the
    complete lines appended since the last call (a line still being written waits for the
    next call; a file not there yet gives none). The console's progress and `enn tune`'s
    pruner read a live job this way."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.offset = 0  # bytes of complete lines already read

    def new(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        out = []
        for line in complete.decode("utf-8", errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a damaged line: the job's own record, never fatal to a reader
                continue
        return out


def read_events(run_dir: str | Path) -> Iterator[dict[str, Any]]:
    path = Path(run_dir) / EVENTS_FILE
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                rec = json.loads(line)
                if rec.get("type") == "metric" and not math.isfinite(rec.get("value", 0.0)):
                    rec["nonfinite"] = True
                yield rec
