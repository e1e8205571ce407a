"""The diagnostics record of a stage run: what the runtime chose and what went wrong, gathered
from the run directory (events.jsonl, heartbeats, error records, stack dumps), so that a
symptom is named where the user looks (the Prefect artifact, MLflow's diagnostics.json).

    diag = diagnostics(ctx.run_dir)      # dict: choices, bottleneck, nonfinite, oom, workers
    write(ctx.run_dir, diag)             # <run_dir>/diagnostics.json (atomic)
    markdown(diag)                       # the Prefect markdown artifact

Sources: the trainer's events (`runtime/*` params: precision, attention backend, compile;
`nonfinite_skip`: tensor, step, rank; `oom_backoff`: micro-batch before/after; the telemetry's
`bottleneck` verdicts), each rank's last heartbeat (phase, step, attempt), each rank's error
record (type, message, phase, step) and the stack dumps the watchdog took.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from enn_core.atomic import write_json
from enn_core.events import read_events
from enn_core.runtime.heartbeat import read_heartbeats, stack_path
from enn_core.runtime.watchdog import read_errors  # not launch: it imports torch
from enn_core.telemetry import markdown_table, read_verdicts

FILE = "diagnostics.json"


def diagnostics(run_dir: str | Path) -> dict[str, Any]:
    """Everything the run directory says about decisions and failures (missing parts empty)."""
    run_dir = Path(run_dir)
    recs = list(read_events(run_dir))
    params = {r["name"]: r["value"] for r in recs if r.get("type") == "param"}
    events = [r for r in recs if r.get("type") == "event"]

    def fields(name: str) -> list[dict[str, Any]]:
        return [dict(e["fields"], time=e.get("time")) for e in events if e.get("name") == name]

    beats = read_heartbeats(run_dir)
    workers = {
        str(r): {k: h.get(k) for k in ("phase", "step", "attempt", "pid")}
        for r, h in sorted(beats.items())
    }
    stacks = [
        str(stack_path(run_dir, r))
        for r in sorted(beats)
        if stack_path(run_dir, r).exists() and stack_path(run_dir, r).stat().st_size > 0
    ]
    errors = [
        {k: e.get(k) for k in ("rank", "type", "message", "phase", "step")}
        for e in read_errors(run_dir)
    ]
    return {
        "run_dir": str(run_dir),
        "choices": {
            k.removeprefix("resolved.runtime."): _plain(v)
            for k, v in params.items()
            if k.startswith("resolved.runtime.")
        },
        "bottleneck": read_verdicts(recs),
        "nonfinite": fields("nonfinite_skip"),
        "fp16_overflow": fields("fp16_overflow_skip"),
        "oom_backoffs": fields("oom_backoff"),
        "workers": workers,
        "errors": errors,
        "stacks": stacks,
        "tables": {r["name"]: r["rows"] for r in recs if r.get("type") == "table"},
        "stage_error": None,
    }


def _plain(v: Any) -> Any:
    """Params the trainer JSON-encoded (dicts such as attention probes) come back decoded."""
    if isinstance(v, str) and v[:1] in "{[":
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    return v


def write(run_dir: str | Path, diag: dict[str, Any]) -> Path:
    path = Path(run_dir) / FILE
    write_json(path, diag)
    return path


def headline(diag: dict[str, Any]) -> list[str]:
    """One line per finding, most actionable first."""
    out = []
    if err := diag.get("stage_error"):
        out.append(f"stage failed: {err['type']}: {err['message']}")
    for e in diag["errors"][:1]:
        step = f" step {e['step']}" if e.get("step") is not None else ""
        out.append(
            f"rank {e['rank']} failed in phase {e['phase']}{step}: {e['type']}: {e['message']}"
        )
    if diag["stacks"]:
        out.append(f"stack dumps of a hung job: {', '.join(diag['stacks'])}")
    for e in diag["nonfinite"][:1]:
        out.append(
            f"non-finite {e.get('tensor') or 'value'} at step {e.get('step')} "
            f"on rank {e.get('rank')} "
            f"({len(diag['nonfinite'])} skipped step(s))"
        )
    for e in diag["oom_backoffs"]:
        out.append(
            f"out of memory at step {e.get('step')}: micro-batch {e.get('micro_batch_before')} -> "
            f"{e.get('micro_batch_after')} (accumulation {e.get('accumulation_after')})"
        )
    kinds = [v.get("verdict") for v in diag["bottleneck"]]
    if kinds:
        last = diag["bottleneck"][-1]
        out.append(f"bottleneck: {last.get('verdict')} in the last epoch ({last.get('reason')})")
    c = diag["choices"]
    if c.get("attention"):
        out.append(
            f"attention backend {c['attention']} ({c.get('attention_reason', '')}); precision "
            f"{c.get('precision')}; compile {c.get('compile')}"
        )
    return out


def markdown(diag: dict[str, Any]) -> str:
    """The Prefect artifact: findings, the per-epoch bottleneck table, each rank's last phase."""
    lines = ["## Diagnostics", ""]
    lines += [f"- {h}" for h in headline(diag)] or ["- nothing to report"]
    if diag["bottleneck"]:
        lines += ["", "### Bottleneck per epoch", "", markdown_table(diag["bottleneck"])]
    if diag["workers"]:
        lines += [
            "",
            "### Workers (last heartbeat)",
            "",
            "| rank | phase | step | attempt |",
            "| --- | --- | --- | --- |",
        ]
        lines += [
            f"| {r} | {w['phase']} | {w['step']} | {w['attempt']} |"
            for r, w in diag["workers"].items()
        ]
    for name, rows in (diag.get("tables") or {}).items():
        if rows:
            lines += ["", f"### {name.replace('_', ' ').capitalize()}", "", _table(rows)]
    return "\n".join(lines) + "\n"


def _table(rows: list[dict[str, Any]]) -> str:
    cols = list(rows[0])
    head = "| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols) + "\n"
    return head + "".join("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |\n" for r in rows)


def _cell(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else ("" if v is None else str(v).replace("|", "/"))
