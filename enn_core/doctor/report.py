"""The doctor's result: one line per check (ok / warn / fail / skip, the measured detail, the
fix), as a table for people and JSON for machines.

    report = Report(checks, device="cpu", quick=True)
    print(report.table()); json.dumps(report.as_json())
    sys.exit(report.exit_code)          # 1 when any check failed, else 0
"""

from __future__ import annotations

import shutil
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

STATUSES = ("ok", "warn", "fail", "skip")
_MARK = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


@dataclass(frozen=True)
class Check:
    """One line of the report. `data` holds the raw measurements (JSON only)."""

    layer: str
    name: str
    status: str
    detail: str
    fix: str = ""
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check status {self.status!r} is not one of {STATUSES}")


class Recorder:
    """Collects the checks of one layer; `timed` measures the check it wraps."""

    def __init__(self, layer: str) -> None:
        self.layer = layer
        self.checks: list[Check] = []

    def add(
        self, name: str, status: str, detail: str, fix: str = "", seconds: float = 0.0, **data: Any
    ) -> Check:
        check = Check(self.layer, name, status, detail, fix, round(seconds, 3), data)
        self.checks.append(check)
        return check

    @contextmanager
    def timer(self) -> Iterator[Callable[[], float]]:
        """`with rec.timer() as elapsed: ...; elapsed()` -> seconds since entry."""
        t0 = time.perf_counter()
        yield lambda: time.perf_counter() - t0


@dataclass
class Report:
    checks: list[Check]
    device: str
    quick: bool
    layers: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        """Non-zero when any check failed (warnings do not fail the run)."""
        return 1 if any(c.status == "fail" for c in self.checks) else 0

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in STATUSES}

    def by_status(self, status: str) -> list[Check]:
        return [c for c in self.checks if c.status == status]

    def find(self, layer: str, name: str | None = None) -> list[Check]:
        return [c for c in self.checks if c.layer == layer and (name is None or c.name == name)]

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.exit_code == 0,
            "exit_code": self.exit_code,
            "device": self.device,
            "quick": self.quick,
            "layers": self.layers,
            "seconds": round(self.seconds, 3),
            "counts": self.counts(),
            "checks": [asdict(c) for c in self.checks],
        }

    def table(self, width: int | None = None) -> str:
        """Aligned columns: status, layer, check, detail; the fix on an indented line below."""
        width = width or max(80, shutil.get_terminal_size((120, 24)).columns)
        lw = max([len(c.layer) for c in self.checks] + [5])
        nw = max([len(c.name) for c in self.checks] + [5])
        head = f"{'STATUS':<6}  {'LAYER':<{lw}}  {'CHECK':<{nw}}  DETAIL"
        indent = " " * (6 + 2 + lw + 2 + nw + 2)
        lines = [head, "-" * min(width, len(head) + 40)]
        for c in self.checks:
            first = f"{_MARK[c.status]:<6}  {c.layer:<{lw}}  {c.name:<{nw}}  "
            body = textwrap.wrap(c.detail, max(30, width - len(indent))) or [""]
            lines.append(first + body[0])
            lines += [indent + more for more in body[1:]]
            if c.fix and c.status in ("warn", "fail"):
                fix = textwrap.wrap("fix: " + c.fix, max(30, width - len(indent)))
                lines += [indent + f for f in fix]
        n = self.counts()
        verdict = "FAILED" if self.exit_code else "passed"
        lines.append(
            f"doctor {verdict}: {n['ok']} ok, {n['warn']} warn, {n['fail']} fail, "
            f"{n['skip']} skipped "
            f"on {self.device} in {self.seconds:.1f} s" + (" (--quick)" if self.quick else "")
        )
        return "\n".join(lines)
