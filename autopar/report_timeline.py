"""The predicted pipeline schedule as a list of passes, redrawn from a plan summary.

The order of passes on each rank comes from the schedule kind (cost_models.pipeline.rank_order:
GPipe, 1F1B, interleaved with vp chunks) and their durations from the summary's stage forward and
backward times; the start times come from the same event simulation the cost model runs
(cost_models.pipeline.simulate), with the inter-stage transfer time the summary records. So the
timeline's makespan equals the model's pipeline time (`summary["pipeline"]["makespan_s"]`) up to
float rounding, which tests/test_report.py asserts. The closed-form `estimate` is used only to rank
many candidates; it agrees with the simulation for uniform stages without transfers.
"""

from __future__ import annotations

from typing import Any

from autopar.cost_models.pipeline import simulate


def schedule_inputs(summary: dict[str, Any]) -> dict[str, Any]:
    """Schedule parameters from a summary; an old summary without `pipeline` gets p2p 0."""
    s = summary["strategy"]
    pipeline = summary.get("pipeline") or {}
    return {"schedule": s["schedule"], "pp": int(s["pp"]), "vp": int(s["vp"]),
            "num_microbatches": int(s["num_microbatches"]), "p2p_s": float(pipeline.get("p2p_s", 0.0))}


def timeline(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Passes as plain dicts: rank, kind (F/B), virtual stage, micro-batch, start_s, end_s; sorted by
    rank then start."""
    inputs = schedule_inputs(summary)
    stages = sorted(summary["stages"], key=lambda st: st["index"])
    result = simulate([st["forward_s"] for st in stages], [st["backward_s"] for st in stages],
                      inputs["num_microbatches"], inputs["schedule"], pp=inputs["pp"], vp=inputs["vp"],
                      p2p_s=inputs["p2p_s"])
    passes = [{"rank": x.rank, "kind": x.kind, "stage": x.stage, "microbatch": x.microbatch,
               "start_s": x.start_s, "end_s": x.end_s} for x in result.timeline]
    passes.sort(key=lambda x: (x["rank"], x["start_s"]))
    return passes


def makespan_s(passes: list[dict[str, Any]]) -> float:
    return max((x["end_s"] for x in passes), default=0.0)


def idle_s(passes: list[dict[str, Any]], pp: int) -> list[float]:
    """Per rank: time without a pass between 0 and the makespan (fill, drain and waits: the bubble)."""
    end = makespan_s(passes)
    busy = [0.0] * pp
    for x in passes:
        busy[x["rank"]] += x["end_s"] - x["start_s"]
    return [end - b for b in busy]
