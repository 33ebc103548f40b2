"""Pipeline schedules, simulated: step time with bubbles, per-rank busy time, the timeline, and
the peak number of micro-batch activations each rank holds.

A schedule is the order in which each rank runs forward (F) and backward (B) passes of its
(virtual) stages; the simulator starts each pass when its rank is free and its input has arrived
(F of the previous stage, or B of the next, plus the point-to-point transfer time). The orders
follow GPipe (all forwards, then all backwards), 1F1B (Narayanan et al., PipeDream-Flush, 2021)
and interleaved 1F1B with v virtual stages per rank (Narayanan et al., SC'21, §2.2); the zero-bubble
schedules, whose backward is split into input- and weight-gradient passes, are in `zero_bubble`.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from autopar.cost_models.pipeline_passes import Pass, PipelineResult, run_passes  # Pass: the report reads it here

SCHEDULES = ("gpipe", "1f1b", "interleaved")
SCHEDULES += ("interleaved_zb", "zbv")  # `cost_models.zero_bubble`


def rank_order(schedule: str, rank: int, pp: int, num_microbatches: int, vp: int = 1) -> list[tuple[str, int, int]]:
    """The (kind, chunk, microbatch) passes rank `rank` runs, in order."""
    if schedule in ("interleaved_zb", "zbv"):
        from autopar.cost_models.zero_bubble import zero_bubble_order
        return zero_bubble_order(schedule, rank, pp, num_microbatches, vp)
    m = num_microbatches
    if schedule == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(pp - rank - 1, m)
        order = [("F", 0, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", 0, warmup + i), ("B", 0, i)]
        return order + [("B", 0, i) for i in range(m - warmup, m)]
    if schedule == "interleaved":
        total = m * vp

        def unit(k: int, backward: bool) -> tuple[int, int]:
            group, within = divmod(k, pp * vp)
            chunk = within // pp
            return (vp - 1 - chunk if backward else chunk), group * pp + within % pp

        warmup = min((pp - rank - 1) * 2 + (vp - 1) * pp, total)
        order = [("F", *unit(k, False)) for k in range(warmup)]
        for k in range(total - warmup):
            order += [("F", *unit(warmup + k, False)), ("B", *unit(k, True))]
        return order + [("B", *unit(k, True)) for k in range(total - warmup, total)]
    raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")


def simulate(
    forward_s: list[float],
    backward_s: list[float],
    num_microbatches: int,
    schedule: str,
    *,
    pp: int,
    vp: int = 1,
    p2p_s: float = 0.0,
    stage_weight: list[float] | None = None,
    weight_s: list[float] | None = None,
) -> PipelineResult:
    """`forward_s[s]`, `backward_s[s]`: one micro-batch's pass on virtual stage s (len pp·vp).

    `stage_weight[s]` is what one held micro-batch costs on stage s (e.g. activation bytes); the
    result's peak_in_flight is the peak of their sum per rank. `weight_s[s]`: the weight-gradient
    part of `backward_s[s]`, which the zero-bubble schedules run as a pass of its own.
    """
    if schedule in ("interleaved_zb", "zbv"):
        from autopar.cost_models.zero_bubble import simulate_split_backward
        return simulate_split_backward(forward_s, backward_s, weight_s, num_microbatches, schedule, pp=pp, vp=vp,
                                       p2p_s=p2p_s, stage_weight=stage_weight)
    stages = pp * vp
    assert len(forward_s) == len(backward_s) == stages
    weights = stage_weight or [1.0] * stages
    return run_passes(_stage_orders(schedule, pp, num_microbatches, vp),
                      lambda kind, stage: forward_s[stage] if kind == "F" else backward_s[stage],
                      lambda kind, stage, mb, done: _ready_time(kind, stage, mb, stages, pp, done, p2p_s),
                      weights, "B", f"schedule {schedule} deadlocked (pp={pp}, vp={vp}, m={num_microbatches})")


@lru_cache(maxsize=256)
def _stage_orders(schedule: str, pp: int, num_microbatches: int, vp: int
                  ) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Per rank, its passes as (kind, virtual stage, micro-batch): `rank_order` with chunks made stages.
    Kept per schedule shape, since the search simulates the same shape under many stage times."""
    return tuple(tuple((kind, chunk * pp + rank, mb) for kind, chunk, mb in rank_order(schedule, rank, pp,
                                                                                       num_microbatches, vp))
                 for rank in range(pp))


def _ready_time(kind: str, stage: int, mb: int, stages: int, pp: int, done: dict, p2p_s: float) -> float | None:
    """When a pass's input is available, or None if its producer has not run yet."""
    if kind == "F":
        if stage == 0:
            return 0.0
        previous = done.get(("F", stage - 1, mb))
        return None if previous is None else previous + (p2p_s if pp > 1 else 0.0)
    own_forward = done.get(("F", stage, mb))
    if own_forward is None:
        return None
    if stage == stages - 1:
        return own_forward
    following = done.get(("B", stage + 1, mb))
    return None if following is None else max(own_forward, following + (p2p_s if pp > 1 else 0.0))


def estimate(
    forward_s: list[float],
    backward_s: list[float],
    num_microbatches: int,
    schedule: str,
    *,
    pp: int,
    vp: int = 1,
    p2p_s: float = 0.0,
    stage_weight: list[float] | None = None,
    weight_s: list[float] | None = None,
) -> PipelineResult:
    """Closed-form stand-in for `simulate`: its step time exact for uniform stages and no transfer
    time, its peaks (`peak_held`) exact for any stages.

    The slowest rank sets the steady-state pace; the fill and drain add (pp-1) passes of an
    average rank, divided by vp when interleaved (Narayanan et al., SC'21, §2.2); with uneven
    chunks (Llama 3's embedding and head alone) that is within 1% of the simulation
    (tests/test_uneven_stages.py). Used to rank many candidates quickly; the chosen ones are simulated.
    """
    if schedule in ("interleaved_zb", "zbv"):
        from autopar.cost_models.zero_bubble import estimate_split_backward
        return estimate_split_backward(forward_s, backward_s, weight_s, num_microbatches, schedule, pp=pp, vp=vp,
                                       p2p_s=p2p_s, stage_weight=stage_weight)
    m = num_microbatches
    weights = stage_weight or [1.0] * (pp * vp)
    step, per_rank = _estimated_step(forward_s, backward_s, m, schedule, pp, vp, p2p_s)
    peaks = [peak_held(schedule, rank, pp, m, vp, [weights[rank + c * pp] for c in range(vp)])
             for rank in range(pp)]
    busy = tuple(m * w for w in per_rank)
    return PipelineResult(
        step_time_s=step, rank_busy_s=busy, rank_end_s=tuple(step for _ in range(pp)),
        peak_in_flight=tuple(peaks), timeline=(),
    )


def _estimated_step(forward_s: list[float], backward_s: list[float], m: int, schedule: str, pp: int, vp: int,
                    p2p_s: float) -> tuple[float, list[float]]:
    """`estimate`'s step time and each rank's busy time per micro-batch (1F1B family)."""
    per_rank = [sum(forward_s[r + c * pp] + backward_s[r + c * pp] for c in range(vp)) for r in range(pp)]
    slowest = max(per_rank)
    fill = (pp - 1) * (sum(per_rank) / pp) / (vp if schedule == "interleaved" else 1)
    transfers = 2 * (pp - 1) * p2p_s * (vp if schedule == "interleaved" else 1)
    return m * slowest + fill + transfers, per_rank


def estimated_step_s(forward_s: list[float], backward_s: list[float], num_microbatches: int, schedule: str, *,
                     pp: int, vp: int = 1, p2p_s: float = 0.0, weight_s: list[float] | None = None) -> float:
    """`estimate`'s step time alone (no peaks), by the same arithmetic: non-decreasing in every
    forward and backward time and in `p2p_s` (with `weight_s` held), which `cost_models.bounds` relies on."""
    if schedule in ("interleaved_zb", "zbv"):
        from autopar.cost_models.zero_bubble import split_backward_step
        return split_backward_step(forward_s, backward_s, weight_s, num_microbatches, schedule, pp=pp, vp=vp,
                                   p2p_s=p2p_s)[0]
    return _estimated_step(forward_s, backward_s, num_microbatches, schedule, pp, vp, p2p_s)[0]


@lru_cache(maxsize=4096)
def in_flight_counts(schedule: str, rank: int, pp: int, num_microbatches: int, vp: int = 1
                     ) -> tuple[tuple[int, ...], ...]:
    """Per chunk, how many micro-batches' activations rank `rank` holds just after each of its
    forwards (where its memory can peak), the distinct vectors only. Holding depends on the rank's
    pass order alone, not on timing: a forward of chunk c adds one to c, a backward removes one.
    1F1B: ((min(pp - rank, m),)); GPipe: ((m,)); interleaved: the warm-up's forwards spread over the
    chunks, then the steady state's, which with uneven chunks can peak later than the warm-up."""
    if schedule == "gpipe":
        return ((num_microbatches,),)
    if schedule == "1f1b":
        return ((min(pp - rank, num_microbatches),),)
    held = [0] * vp
    vectors: dict[tuple[int, ...], None] = {}
    order = rank_order(schedule, rank, pp, num_microbatches, vp)
    for position, (kind, chunk, _) in enumerate(order):
        held[chunk] += 1 if kind == "F" else -1
        if kind == "F" and (position + 1 == len(order) or order[position + 1][0] == "B"):
            vectors[tuple(held)] = None  # a forward the next pass undoes in part: a local peak
    return _undominated(vectors)


def _undominated(vectors) -> tuple[tuple[int, ...], ...]:
    """The vectors no other one covers element by element (only those can hold the peak). In
    decreasing order of their sums, a vector is covered by some kept one if by any."""
    ordered = sorted(vectors, key=lambda w: (-sum(w), w))
    kept = np.empty((len(ordered), len(ordered[0]) if ordered else 0), dtype=np.int64)
    count = 0
    for v in ordered:
        row = np.asarray(v)
        if not count or not (kept[:count] >= row).all(axis=1).any():
            kept[count] = row
            count += 1
    return tuple(tuple(int(n) for n in row) for row in kept[:count])


def peak_held(schedule: str, rank: int, pp: int, num_microbatches: int, vp: int, chunk_weights: list[float]) -> float:
    """The peak over a step of Σ_c held_c · chunk_weights[c] on rank `rank` (`in_flight_counts`):
    what `simulate` finds, in closed form, for any chunk weights, even or not."""
    return max(sum(n * w for n, w in zip(counts, chunk_weights))
               for counts in in_flight_counts(schedule, rank, pp, num_microbatches, vp))
