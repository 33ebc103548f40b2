"""The predicted pipeline schedule as a list of passes, redrawn from the report model.

The order of passes on each rank comes from the schedule kind (cost_models.pipeline.rank_order:
GPipe, 1F1B, interleaved with vp chunks) and their durations from the report's stage forward and
backward times; the start times come from the same event simulation the cost model runs
(cost_models.pipeline.simulate), with the inter-stage transfer time the report records. So the
timeline's makespan equals the model's pipeline time (`report.pipeline.makespan_s`) up to float
rounding, which tests/test_report.py asserts. The closed-form `estimate` is used only to rank
many candidates; it agrees with the simulation for uniform stages without transfers.
"""

from __future__ import annotations

from autopar.cost_models.pipeline import Pass, simulate
from autopar.report.model import EvaluationReport, Report


def p2p_s(report: EvaluationReport) -> float:
    """The transfer time between stages; 0 for a report without pipeline data."""
    pipeline = getattr(report, "pipeline", None)
    return pipeline.p2p_s if pipeline is not None else 0.0


def timeline(report: Report | EvaluationReport) -> list[Pass]:
    """Every pass of one step (rank, kind F/B, virtual stage, micro-batch, start_s, end_s), sorted by
    rank then start."""
    s = report.strategy
    stages = sorted(report.stages, key=lambda st: st.index)
    result = simulate([st.forward_s for st in stages], [st.backward_s for st in stages], s.num_microbatches,
                      s.schedule, pp=s.pp, vp=s.vp, p2p_s=p2p_s(report),
                      weight_s=[st.backward_weight_s for st in stages])
    return sorted(result.timeline, key=lambda x: (x.rank, x.start_s))


def makespan_s(passes: list[Pass]) -> float:
    return max((x.end_s for x in passes), default=0.0)


def idle_s(passes: list[Pass], pp: int) -> list[float]:
    """Per rank: time without a pass between 0 and the makespan (fill, drain and waits: the bubble)."""
    end = makespan_s(passes)
    busy = [0.0] * pp
    for x in passes:
        busy[x.rank] += x.end_s - x.start_s
    return [end - b for b in busy]
