"""`enn doctor`: the execution path checked layer by layer, each line ok / warn / fail with the
measured detail and the fix (the operational risk map as checks; docs/troubleshooting.md).

    report = run_doctor(cfg, layout, quick=True, only=["data", "model"])
    report.exit_code                      # 1 when any check failed
    main(cfg, layout, quick=False, as_json=False, only=None) -> int   # prints; the CLI's body

Layers, in the order a run goes through them: data, model, kernels, precision, workers,
distributed, checkpoints, export. `--quick` skips the slow checks (torch.compile,
torch.export). A layer that raises something unexpected becomes a failed line naming it:
the doctor itself never stops half-way.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from enn_core.config import RunConfig
from enn_core.doctor import (
    checkpoints,
    data,
    distributed,
    export,
    kernels,
    model,
    precision,
    workers,
)
from enn_core.doctor.context import DoctorContext
from enn_core.doctor.report import Check, Report
from enn_core.errors import ConfigError
from enn_core.paths import Layout

LAYERS: dict[str, Callable[[DoctorContext], list[Check]]] = {
    "data": data.run,
    "model": model.run,
    "kernels": kernels.run,
    "precision": precision.run,
    "workers": workers.run,
    "distributed": distributed.run,
    "checkpoints": checkpoints.run,
    "export": export.run,
}


def parse_only(only: str | Sequence[str] | None) -> list[str] | None:
    """'data,model' or ['data', 'model'] -> validated layer names (None = all)."""
    if only is None:
        return None
    names = [n.strip() for n in (only.split(",") if isinstance(only, str) else only) if n.strip()]
    unknown = [n for n in names if n not in LAYERS]
    if unknown or not names:
        raise ConfigError(
            f"doctor --only {','.join(names) or '(empty)'}: unknown layer(s) {unknown}; "
            f"use some of {','.join(LAYERS)}"
        )
    return names


def run_doctor(
    cfg: RunConfig, layout: Layout, *, quick: bool, only: list[str] | None = None
) -> Report:
    """Run the checks of every layer (or of `only`) and return the report."""
    layers = parse_only(only) or list(LAYERS)
    ctx = DoctorContext.create(cfg, layout, quick)
    t0 = time.perf_counter()
    checks: list[Check] = []
    try:
        for name in layers:
            checks += _run_layer(name, ctx)
    finally:
        ctx.close()
    return Report(
        checks, device=str(ctx.device), quick=quick, layers=layers, seconds=time.perf_counter() - t0
    )


def _run_layer(name: str, ctx: DoctorContext) -> list[Check]:
    t0 = time.perf_counter()
    try:
        return LAYERS[name](ctx)
    except Exception as e:  # noqa: BLE001 - an unexpected error is a failed line, not a crash
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        return [
            Check(
                name,
                "unexpected error",
                "fail",
                f"{type(e).__name__}: {first}",
                "a defect in this check or an environment it does not know: "
                "report it with this line",
                round(time.perf_counter() - t0, 3),
            )
        ]


def main(
    cfg: RunConfig,
    layout: Layout,
    quick: bool = False,
    as_json: bool = False,
    only: str | Sequence[str] | None = None,
    out: TextIO | None = None,
) -> int:
    """The CLI body: run, print the table (or JSON), return the exit code (1 on any fail)."""
    out = out or sys.stdout
    report = run_doctor(cfg, layout, quick=quick, only=parse_only(only))
    if as_json:
        json.dump(report.as_json(), out, indent=2, default=str)
        out.write("\n")
    else:
        out.write(report.table() + "\n")
    out.flush()
    return report.exit_code


__all__ = ["LAYERS", "Check", "Report", "main", "parse_only", "run_doctor"]
