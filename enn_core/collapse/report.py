"""collapse-check's report (`report.json`) as records: every candidate, how far each was from
passing, the cause of a collapse and the choice; and the verdict as a person reads it
(`verdict_lines`; a label mostly one value: `mostly_one_value`).

JSON only at the file boundary: `CollapseReport.to_json()` writes the same keys the report has
always had (`chosen_metrics` included), and `from_json` reads reports of this format version
and of earlier versions, which carried no `format_version`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from enn_core.data.label_mode import LabelMode
from enn_core.errors import StaleOutputError
from enn_core.metrics import best_naive

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
    label_mode: float | None = None
    """A label mostly one value: the training labels' majority value (of the output where it
    holds the most; enn_core.data.label_mode), read only when every candidate collapsed."""
    label_mode_share: float | None = None  # its share of that output's training rows
    label_mostly_outputs: int | None = None  # the outputs whose majority holds > half


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


SECTION = 'docs/your-data.md, "A label that is mostly one value"'
LITTLE_SKILL = 0.05  # below this share of the naive MAE removed, "little or no skill"
# the spread criteria a model near a constant fails, and the collapse.* key that sets each
RELAX = {
    "spread_median": "collapse.median_ratio_min",
    "spread_p10": "collapse.p10_ratio_min",
    "flat_fraction": "collapse.max_flat_fraction",
    "broadcast_fraction": "collapse.max_broadcast_fraction",
}


def mostly_one_value(mode: LabelMode, raw: Candidate) -> str:
    """The diagnosis of a collapse on a label mostly one value: MAE's best answer is about
    that value, how the raw predictions compare with the best naive predictor, what to do."""
    where = (
        ""
        if len(mode.shares) == 1
        else f" of the output where it holds the most ({mode.n_mostly} of {len(mode.shares)} "
        "outputs are mostly one value)"
    )
    failed = [c for c in raw.criteria if not c.ok]
    return (
        f"a label mostly one value: {mode.top_share:.0%} of the training labels{where} are "
        f"{mode.top_value:g}, so under MAE the best constant is about {mode.top_value:g}; the "
        f"raw predictions stay near it ({', '.join(c.describe() for c in failed)}) with "
        f"{_skill(raw)}; see {SECTION}: a metric and loss that fit the label, a hurdle model"
        f"{_relax(raw, ', or ')}"
    )


def _gain(raw: Candidate) -> float:
    """The share of the best naive predictor's MAE the raw predictions remove (NaN unknown)."""
    mae, naive = raw.measures.get("mae", math.nan), raw.measures.get("naive_best_mae", math.nan)
    ok = math.isfinite(mae) and math.isfinite(naive) and naive > 0
    return 1.0 - mae / naive if ok else math.nan


def _skill(raw: Candidate) -> str:
    """'MAE 0.7353 vs 0.744 for the best naive predictor (naive_cell_median), 1.2% lower:
    little or no skill over the constant'."""
    mae, naive = raw.measures.get("mae", math.nan), raw.measures.get("naive_best_mae", math.nan)
    name = best_naive(raw.metrics) or "the naive predictors"
    head = f"MAE {mae:.4g} vs {naive:.4g} for the best naive predictor ({name})"
    gain = _gain(raw)
    if math.isnan(gain):
        return head
    if gain < 0:
        return f"{head}, {-gain:.1%} higher: worse than the constant"
    if gain < LITTLE_SKILL:
        return f"{head}, {gain:.1%} lower: little or no skill over the constant"
    return f"{head}, {gain:.1%} lower: some skill, with little spread"


def _relax(raw: Candidate, joiner: str) -> str:
    """The collapse.* keys the raw candidate fails, to relax knowingly (after `joiner`); not
    where the model is worse than the constant: relaxing would ship it."""
    keys = [RELAX[c.measure] for c in raw.criteria if not c.ok and c.measure in RELAX]
    named = ", ".join(keys) or "collapse.*"
    if _gain(raw) < 0:
        return f" (relaxing {named} would ship predictions worse than the constant)"
    return f"{joiner}relax {named} knowingly"


def verdict_lines(report: CollapseReport) -> list[str]:
    """collapse-check's verdict on a failed check as a person reads it: the cause it sees and
    what to try, each one short line (the candidates' figures are in the report)."""
    cause, raw = report.cause, report.candidates.get("raw")
    value, share = cause.label_mode, cause.label_mode_share
    if value is not None and share is not None and raw is not None and raw.measures:
        spread = raw.measures.get("spread_median", math.nan)
        return [
            f"cause: the label is mostly one value ({share:.0%} of the training labels are "
            f"{value:g}): MAE's best constant is about {value:g}, and the model stays near it "
            f"(spread_median {spread:.3g})",
            f"the model: {_skill(raw)}",
            f"try: a hurdle model, or another metric and loss ({SECTION})",
            _relax(raw, "or ").strip(" ()"),
        ]
    return [
        f"cause: {cause.diagnosis.split(';')[0]}",
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
