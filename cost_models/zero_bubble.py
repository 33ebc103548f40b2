"""Zero-bubble pipeline schedules, simulated: the backward split into an input-gradient pass (B) and a
weight-gradient pass (W), as Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (§2) split it.

B computes the gradient a stage sends to the stage before it; W, the gradient of the stage's weights,
depends on nothing downstream, so the schedule defers it into what would be bubbles. Two shapes, as
torch.distributed.pipelining runs them (the orders here are checked against torch's in the tests):

- interleaved_zb (torch's ScheduleInterleavedZeroBubble, the paper's ZB-H1 shape, §3.1, over vp loop-placed
  chunks): interleaved 1F1B with one fewer warm-up forward per hop, B in place of the full backward,
  and rank r's W passes trailing its B passes by r;
- zbv (torch's ScheduleZBVZeroBubble, the paper's ZB-V, §6): two chunks per rank in a V (rank r runs
  stages r and 2pp-1-r), warm-up forwards of chunk 0 then chunk 1, a steady state of F B W per chunk.

Until W runs, autograd keeps the stage's whole graph (torch's input-gradient pass retains it for the
weight pass), so a micro-batch's activations are held from its F until its W, not its B.
"""

from __future__ import annotations

from autopar.cost_models.pipeline_passes import PipelineResult, run_passes
from autopar.plan_schema import stage_rank

ZERO_BUBBLE_SCHEDULES = ("interleaved_zb", "zbv")


def virtual_stage(schedule: str, chunk: int, rank: int, pp: int) -> int:
    """The stage rank `rank`'s chunk `chunk` runs (`plan_schema.stage_rank` inverted)."""
    if schedule == "zbv" and chunk % 2:
        return chunk * pp + pp - 1 - rank
    return chunk * pp + rank


def zero_bubble_order(schedule: str, rank: int, pp: int, num_microbatches: int, vp: int
                      ) -> list[tuple[str, int, int]]:
    """The (kind, chunk, microbatch) passes rank `rank` runs, kinds F, B (input gradient), W (weights)."""
    if schedule == "interleaved_zb":
        return _interleaved_zb_order(rank, pp, num_microbatches, vp)
    if schedule == "zbv":
        return _zbv_order(rank, pp, num_microbatches)
    raise ValueError(f"unknown zero-bubble schedule {schedule!r}; known: {', '.join(ZERO_BUBBLE_SCHEDULES)}")


def _interleaved_zb_order(rank: int, pp: int, m: int, vp: int) -> list[tuple[str, int, int]]:
    """Micro-batches go round the chunks in groups of pp (m divisible by pp); forwards walk the
    chunks up, backwards down. Warm-up: (vp-1)·pp forwards plus one per hop to the last rank."""
    total = m * vp

    def unit(k: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(k, pp * vp)
        chunk = within // pp
        return (vp - 1 - chunk if backward else chunk), group * pp + within % pp

    warmup = min((vp - 1) * pp + (pp - 1 - rank), total)
    order = [("F", *unit(k, False)) for k in range(warmup)]
    weights = 0
    for k in range(total):  # the k-th B, after the forward that keeps the pipe full
        if warmup + k < total:
            order.append(("F", *unit(warmup + k, False)))
        order.append(("B", *unit(k, True)))
        if k >= rank:  # W trails B by `rank` passes: the slack its rank has before the next B arrives
            order.append(("W", *unit(weights, True)))
            weights += 1
    return order + [("W", *unit(k, True)) for k in range(weights, total)]


def _zbv_order(rank: int, pp: int, m: int) -> list[tuple[str, int, int]]:
    """The V: chunk 0 runs down the ranks, chunk 1 back up, so the last rank turns a micro-batch
    around at once. The shape is laid out for max(m, 2pp-1) micro-batches (enough to fill the V),
    and passes of micro-batches beyond m are left out."""
    n = max(m, 2 * pp - 1)
    order: list[tuple[str, int, int]] = []
    count = {(kind, chunk): 0 for kind in "FBW" for chunk in (0, 1)}

    def run(kind: str, chunk: int) -> None:
        order.append((kind, chunk, count[kind, chunk]))
        count[kind, chunk] += 1

    for _ in range(2 * (pp - rank) - 1):
        run("F", 0)
    for _ in range(rank):
        run("F", 1)
        run("F", 0)
    for _ in range(pp - rank):
        for kind in "FBW":
            run(kind, 1)
    while count["F", 1] < count["F", 0] or count["F", 0] < n:  # steady: F B W on each chunk in turn
        if count["F", 0] < n:
            run("F", 0)
        run("B", 0)
        run("W", 0)
        for kind in "FBW":
            run(kind, 1)
    for _ in range(rank):  # drain: the remaining input gradients first, weights where slack is left
        run("B", 0)
        run("B", 1)
    for _ in range(pp - rank):
        run("B", 0)
        run("W", 0)
    while count["W", 1] < count["B", 1]:
        run("W", 1)
    while count["W", 0] < count["B", 0]:
        run("W", 0)
    return [(kind, chunk, mb) for kind, chunk, mb in order if mb < m]


def simulate_split_backward(forward_s: list[float], backward_s: list[float], weight_s: list[float] | None,
                            num_microbatches: int, schedule: str, *, pp: int, vp: int, p2p_s: float,
                            stage_weight: list[float] | None):
    """`pipeline.simulate` for the zero-bubble schedules: `weight_s[s]` is the W part of `backward_s[s]`
    (None: no W part, B runs the whole backward). A transfer costs `p2p_s` only between two ranks."""

    stages = pp * vp
    weight_s = weight_s or [0.0] * stages
    assert len(forward_s) == len(backward_s) == len(weight_s) == stages
    duration = {"F": forward_s, "B": [b - w for b, w in zip(backward_s, weight_s)], "W": weight_s}
    weights = stage_weight or [1.0] * stages
    orders = [[(kind, virtual_stage(schedule, chunk, rank, pp), mb)
               for kind, chunk, mb in zero_bubble_order(schedule, rank, pp, num_microbatches, vp)]
              for rank in range(pp)]
    return run_passes(orders, lambda kind, stage: duration[kind][stage],
                      lambda kind, stage, mb, done: _split_ready_time(kind, stage, mb, stages, pp, schedule, done, p2p_s),
                      weights, "W", f"schedule {schedule} deadlocked (pp={pp}, vp={vp}, m={num_microbatches})")


def _split_ready_time(kind: str, stage: int, mb: int, stages: int, pp: int, schedule: str, done: dict,
                      p2p_s: float) -> float | None:
    """When a pass's inputs are there (None: not yet): F after F of the stage before, B after this
    stage's F and the next stage's B, W after this stage's B; a transfer between ranks adds p2p_s."""
    def arrival(source: int) -> float:
        return p2p_s if stage_rank(source, pp, schedule) != stage_rank(stage, pp, schedule) else 0.0

    if kind == "W":
        return done.get(("B", stage, mb))
    if kind == "F":
        if stage == 0:
            return 0.0
        previous = done.get(("F", stage - 1, mb))
        return None if previous is None else previous + arrival(stage - 1)
    own_forward = done.get(("F", stage, mb))
    if own_forward is None or stage == stages - 1:
        return own_forward
    following = done.get(("B", stage + 1, mb))
    return None if following is None else max(own_forward, following + arrival(stage + 1))


def estimate_split_backward(forward_s: list[float], backward_s: list[float], weight_s: list[float] | None,
                            num_microbatches: int, schedule: str, *, pp: int, vp: int, p2p_s: float,
                            stage_weight: list[float] | None):
    """Closed-form stand-in for `simulate_split_backward`, to rank many candidates (the chosen are simulated).

    With T_F, T_B (input gradient), T_W one chunk's passes averaged over the stages, the fill and drain
    add (pp-1) hops: under interleaved_zb each hop is T_F + T_B - T_W (ZB-H1, Qi et al. §3.1: W fills
    what 1F1B leaves idle), under zbv T_F + T_B - 2·T_W (ZB-V, §6: both chunks' W fill it), and never
    less than one forward or input-gradient pass (no rank starts before they reach it). Exact for uniform stages where
    the tests check it (test_zero_bubble); the held micro-batches are the simulator's at its peak:
    every rank holds pp·vp chunk activations at its peak (fewer when there are fewer micro-batches).
    interleaved_zb's step is exact for uniform stages, zbv's at T_F = T_B = T_W; zbv's fixed order leaves
    more bubble otherwise (up to 8% of the step on the tests' grid).
    """

    stages, m = pp * vp, num_microbatches
    weights = stage_weight or [1.0] * stages
    step, per_rank, held_by_rank = split_backward_step(forward_s, backward_s, weight_s, m, schedule, pp=pp, vp=vp,
                                                       p2p_s=p2p_s)
    held_chunks = min(2 * pp, 2 * m) if schedule == "zbv" else min(pp * vp, m * vp)
    peaks = tuple(held_chunks * sum(weights[i] for i in held) / len(held) for held in held_by_rank)
    return PipelineResult(step_time_s=step, rank_busy_s=tuple(m * t for t in per_rank),
                          rank_end_s=tuple(step for _ in range(pp)), peak_in_flight=peaks, timeline=())


def split_backward_step(forward_s: list[float], backward_s: list[float], weight_s: list[float] | None,
                        m: int, schedule: str, *, pp: int, vp: int, p2p_s: float
                        ) -> tuple[float, list[float], list[list[int]]]:
    """`estimate_split_backward`'s step time, each rank's busy time per micro-batch, and its stages."""
    stages = pp * vp
    weight_s = weight_s or [0.0] * stages
    held_by_rank = [[i for i in range(stages) if stage_rank(i, pp, schedule) == r] for r in range(pp)]
    per_rank = [sum(forward_s[i] + backward_s[i] for i in held) for held in held_by_rank]
    f, b, w = (sum(values) / stages for values in (forward_s, [x - y for x, y in zip(backward_s, weight_s)], weight_s))
    if schedule == "zbv":
        hop = max(f + b - 2 * w, f, b)
    else:
        hop = max(f + b - w, f, b)  # per chunk: a full stage's / vp
    transfers = 2 * (pp - 1) * p2p_s
    return m * max(per_rank) + (pp - 1) * hop + transfers, per_rank, held_by_rank
