"""collapse-check's report (`report.json`) as records: every candidate, how far each was from
passing, the cause of a collapse and the choice.

JSON only at the file boundary: `CollapseReport.to_json()` writes the same keys the report has
always had (`chosen_metrics` included), and `from_json` reads reports of this format version
and of earlier versions, which carried no `format_version`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from enn_core.errors import StaleOutputError

REPORT_FILE = "report.json"
FORMAT_VERSION = 1
Status = Literal["passed", "failed", "not_applicable"]


@dataclass(frozen=True)
class Criterion:
    """One pass criterion: the measured value, its threshold and how far it is from passing."""

    measure: str
    value: float
    op: str
    threshold: float
    ok: bool
    gap: float

    def describe(self) -> str:
        return f"{self.measure} {self.value:.4g} (needs {self.op} {self.threshold:.4g})"


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One prediction path judged on the validation rows (or why it does not apply)."""

    status: Status
    measures: Mapping[str, float] = field(default_factory=dict)
    criteria: tuple[Criterion, ...] = ()
    reasons: tuple[str, ...] = ()
    distance: float = 0.0
    metrics: Mapping[str, float] = field(default_factory=dict)
    reason: str = ""  # not applicable: why
    slope: Mapping[str, float] | None = None  # calibrated: the fitted slopes' summary

    def explain(self) -> str:
        return "; ".join(self.reasons) or self.reason or self.status

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Candidate:
        return cls(
            status=d["status"],
            measures=dict(d.get("measures") or {}),
            criteria=tuple(Criterion(**c) for c in d.get("criteria") or ()),
            reasons=tuple(d.get("reasons") or ()),
            distance=float(d.get("distance") or 0.0),
            metrics=dict(d.get("metrics") or {}),
            reason=str(d.get("reason") or ""),
            slope=d.get("slope"),
        )


@dataclass(frozen=True, kw_only=True)
class Cause:
    """Which part of the prediction path collapses, from the differences between candidates."""

    batch_dependence: float
    batch_dependent: bool
    diagnosis: str
    precision_effect: float | None = None
    label_mode: float | None = None  # the validation targets' most common value
    label_mode_share: float | None = None  # and the share of the targets it is


@dataclass(frozen=True, kw_only=True)
class CollapseReport:
    status: Literal["passed", "failed"]
    chosen: str | None
    why: str
    order: tuple[str, ...]
    precision: str
    n_rows: int
    thresholds: Mapping[str, float]
    candidates: Mapping[str, Candidate]
    cause: Cause
    model_sha256: str = ""
    data_fingerprint: str = ""
    precision_reason: str = ""
    device: str = ""

    @property
    def chosen_metrics(self) -> Mapping[str, float] | None:
        """The chosen candidate's validation metrics (val/mae, ... in real units)."""
        return self.candidates[self.chosen].metrics if self.chosen else None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["candidates"] = {k: _candidate_json(v) for k, v in self.candidates.items()}
        out["cause"] = {k: v for k, v in out["cause"].items() if v is not None}
        out["chosen_metrics"] = dict(self.chosen_metrics) if self.chosen_metrics else None
        out["format_version"] = FORMAT_VERSION
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str = REPORT_FILE) -> CollapseReport:
        version = d.get("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise StaleOutputError(
                f"{where}: report format_version={version}, this code reads {FORMAT_VERSION}; "
                "re-run collapse-check"
            )
        try:
            return cls(
                status=d["status"],
                chosen=d.get("chosen"),
                why=d["why"],
                order=tuple(d["order"]),
                precision=d["precision"],
                n_rows=int(d["n_rows"]),
                thresholds=dict(d["thresholds"]),
                candidates={k: Candidate.from_json(v) for k, v in d["candidates"].items()},
                cause=Cause(**d["cause"]),
                model_sha256=str(d.get("model_sha256") or ""),
                data_fingerprint=str(d.get("data_fingerprint") or ""),
                precision_reason=str(d.get("precision_reason") or ""),
                device=str(d.get("device") or ""),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise StaleOutputError(
                f"{where}: not a collapse-check report ({type(e).__name__}: {e}); "
                "re-run collapse-check"
            ) from e


def _candidate_json(c: Candidate) -> dict[str, Any]:
    if c.status == "not_applicable":
        return {"status": c.status, "reason": c.reason}
    out = asdict(c)
    del out["reason"]
    if c.slope is None:
        del out["slope"]
    return out


MOSTLY_ONE_VALUE = 0.5  # a label whose most common value is at least this share of it


def label_mode(target: object) -> tuple[float, float] | None:
    """(the most common value of the targets, its share of the finite ones), or None."""
    import numpy as np

    t = np.asarray(target, dtype=np.float64).reshape(-1)
    t = t[np.isfinite(t)]
    if not len(t):
        return None
    values, counts = np.unique(t, return_counts=True)
    i = int(np.argmax(counts))
    return float(values[i]), float(counts[i] / len(t))


def verdict_lines(report: CollapseReport, loss: str = "") -> list[str]:
    """collapse-check's verdict on a failed check as a person reads it: the cause it sees and
    what to try, each one short line (the candidates' figures are in the report)."""
    share, value = report.cause.label_mode_share, report.cause.label_mode
    if share is not None and value is not None and share >= MOSTLY_ONE_VALUE:
        pull = f"; {loss} pulls to it" if loss in ("l1", "quantile") else ""
        return [
            f"cause: the label is mostly one value ({share:.0%} of the validation targets are "
            f"{value:g}): predicting about {value:g} everywhere scores well",
            f"try: train.loss=mse or huber (the mean, not the median{pull}), more epochs, or "
            f"model apart whether a row is {value:g} and how far from it",
        ]
    return [
        f"cause: {report.cause.diagnosis.split(';')[0]}",
        "try: more epochs, another train.lr or a larger model (the report says how far each "
        "candidate was from passing)",
    ]


def read_report(directory: str | Path) -> CollapseReport | None:
    """The report in a collapse-check output folder, or None when there is none."""
    path = Path(directory) / REPORT_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StaleOutputError(f"{path}: not valid JSON ({e}); re-run collapse-check") from e
    return CollapseReport.from_json(data, str(path))
