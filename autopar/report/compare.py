"""Predicted against measured: what `autopar run --profile-steps` prints and appends to the report.

The prediction comes from a report or from a plan file (`Plan.predicted`, what a run holds); the
measurement from the profiled steps. error_pct = (predicted − measured) / measured × 100.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from autopar.plan_schema import Plan
from autopar.report.model import Report
from autopar.report.views import format_value


class _Part(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Measured(_Part):
    """What profiled steps measured; every field optional."""

    step_time_s: float | None = None
    compute_s: list[float | None] = []  # per pipeline rank: forward, backward, recompute, optimizer; no communication
    peak_memory_bytes: list[float | None] = []  # per pipeline rank
    communication_s: float | None = None  # exposed communication per step


class ComparisonRow(_Part):
    metric: str
    unit: str  # "s" or "bytes"
    predicted: float
    measured: float
    error_pct: float | None  # None when the measurement is 0


class _Prediction(_Part):
    step_time_s: float | None
    peak_memory_bytes: list[float]
    communication_s: float | None
    compute_s: list[float]


def _prediction(source: Report | Plan) -> _Prediction:
    if isinstance(source, Report):
        p = source.predicted
        return _Prediction(step_time_s=p.step_time_s, peak_memory_bytes=p.peak_memory_bytes_per_stage,
                           communication_s=p.breakdown.exposed_communication, compute_s=p.compute_s_per_stage)
    p = source.predicted
    if p is None:
        return _Prediction(step_time_s=None, peak_memory_bytes=[], communication_s=None, compute_s=[])
    return _Prediction(step_time_s=p.step_time_s, peak_memory_bytes=list(p.peak_memory_bytes),
                       communication_s=p.breakdown.get("exposed_communication"), compute_s=list(p.compute_s))


def compare(source: Report | Plan, measured: Measured | dict) -> list[ComparisonRow]:
    """Rows of predicted against measured, for the figures both sides have."""
    predicted = _prediction(source)
    got = measured if isinstance(measured, Measured) else Measured.model_validate(measured)
    rows: list[ComparisonRow] = []

    def add(metric: str, unit: str, want: float | None, have: float | None) -> None:
        if want is None or have is None:
            return
        error = None if not have else (want - have) / have * 100.0
        rows.append(ComparisonRow(metric=metric, unit=unit, predicted=want, measured=have, error_pct=error))

    add("step time", "s", predicted.step_time_s, got.step_time_s)
    for rank, have in enumerate(got.compute_s):
        add(f"compute, pp rank {rank}", "s", _at(predicted.compute_s, rank), have)
    for rank, have in enumerate(got.peak_memory_bytes):
        add(f"peak memory, pp rank {rank}", "bytes", _at(predicted.peak_memory_bytes, rank), have)
    add("exposed communication", "s", predicted.communication_s, got.communication_s)
    return rows


def _at(values: list[float], index: int) -> float | None:
    return values[index] if index < len(values) else None


def render_comparison(rows: list[ComparisonRow]) -> str:
    """Predicted against measured as a terminal table."""
    if not rows:
        return "predicted vs measured: nothing measured to compare"
    width = max(len(r.metric) for r in rows)
    lines = ["predicted vs measured", f"  {'':<{width}}  {'predicted':>12}  {'measured':>12}  {'error':>8}"]
    for r in rows:
        error = "n/a" if r.error_pct is None else f"{r.error_pct:+.1f}%"
        lines.append(f"  {r.metric:<{width}}  {format_value(r.predicted, r.unit):>12}  "
                     f"{format_value(r.measured, r.unit):>12}  {error:>8}")
    return "\n".join(lines)
