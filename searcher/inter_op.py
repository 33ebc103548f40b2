"""Inter-op partitioning: cut the unit sequence into contiguous pipeline stages.

With per-micro-batch stage times T_s, a 1F1B step takes about (m-1)·max_s T_s + Σ_s T_s, and
Σ_s T_s is the same for every partition, so the best partition minimizes the bottleneck stage
subject to each stage's memory fitting (Alpa's inter-op pass, Zheng et al., OSDI'22, §5, solves
the same problem jointly with sub-mesh choice; our sub-meshes are uniform dp×tp slices).

Dynamic program over (stages used, units covered): best[s][j] is the smallest bottleneck that
places units [0, j) on s stages; a stage [i, j) is allowed only if its memory, with the number
of micro-batches it holds in flight, fits.

Interleaved (vp > 1 virtual stages per rank, stage s on rank s mod pp): the same program over the
pp·vp virtual stages, so their layer counts may differ (Llama 3 405B's first and last chunks hold
the embedding and the head alone, Dubey et al. 2024, §3.3.2). Balanced chunks balance the ranks'
sums. A rank's memory is the sum over its chunks, which a chain program cannot see: each chunk
must fit in 1/vp of the capacity, holding as many micro-batches as the schedule ever makes it
hold (`cost_models.pipeline.in_flight_counts`). That is sufficient, not necessary; the searcher
evaluates the result exactly beside the even split and keeps the better.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_models.pipeline import in_flight_counts


@dataclass(frozen=True)
class UnitCost:
    """One unit on one rank of its stage, for one micro-batch."""

    time_s: float  # forward + backward (+ recompute, + communication inside)
    state_bytes: float  # parameters, gradients, optimizer states: held once
    activation_bytes: float  # held per in-flight micro-batch
    transient_bytes: float = 0.0  # held once while the unit is differentiated (recompute)


def in_flight(stage: int, stages: int, num_microbatches: int, schedule: str, vp: int = 1) -> int:
    """Micro-batches whose activations stage `stage` holds at its peak (interleaved: the most its
    chunk ever holds on its rank)."""
    if schedule == "gpipe":
        return num_microbatches
    if vp == 1:
        return min(stages - stage, num_microbatches)
    pp = stages // vp
    return max(counts[stage // pp] for counts in in_flight_counts("interleaved", stage % pp, pp, num_microbatches, vp))


def partition(
    costs: list[UnitCost],
    stages: int,
    *,
    num_microbatches: int,
    schedule: str = "1f1b",
    memory_capacity_bytes: float | None = None,
    must_start: set[int] | None = None,
    vp: int = 1,
) -> list[tuple[int, int]] | None:
    """Stage boundaries as [(start, end), ...] over `costs`, or None when nothing fits.

    `stages` counts virtual stages: pp·vp, with `vp` > 1 for the interleaved schedule.

    `must_start`: unit indices that may not share a stage with the unit before them (none by
    default). Ties are broken towards earlier cuts, so the result is deterministic.
    """
    n = len(costs)
    if stages < 1 or stages > n or stages % vp:
        return None
    if vp > 1:
        schedule = "interleaved"
    prefix_time = [0.0]
    prefix_state = [0.0]
    prefix_activation = [0.0]
    for cost in costs:
        prefix_time.append(prefix_time[-1] + cost.time_s)
        prefix_state.append(prefix_state[-1] + cost.state_bytes)
        prefix_activation.append(prefix_activation[-1] + cost.activation_bytes)

    # largest_transient[i][j - i - 1]: the largest transient of units [i, j), built once (O(n²), n units)
    largest_transient = []
    for start in range(n):
        running, row = 0.0, []
        for cost in costs[start:]:
            running = max(running, cost.transient_bytes)
            row.append(running)
        largest_transient.append(row)

    held_by_stage = [in_flight(stage, stages, num_microbatches, schedule, vp) for stage in range(stages)]
    chunk_capacity = memory_capacity_bytes / vp if memory_capacity_bytes is not None else None

    def fits(stage: int, start: int, end: int) -> bool:
        if chunk_capacity is None:
            return True
        transient = largest_transient[start][end - start - 1]
        total = (prefix_state[end] - prefix_state[start]
                 + held_by_stage[stage] * (prefix_activation[end] - prefix_activation[start]) + transient)
        return total <= chunk_capacity

    infinity = float("inf")
    best = [[infinity] * (n + 1) for _ in range(stages + 1)]
    cut = [[-1] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        previous, row, cut_row = best[s - 1], best[s], cut[s]
        first = s - 1  # the first start whose stage fits: a stage's memory grows as it starts earlier or ends
        # later, so the first fitting start never moves back as the end moves on
        # Stage s-1 covers [i, j); leave at least one unit for each later stage.
        for j in range(s, n - (stages - s) + 1):
            while first < j and not fits(s - 1, first, j):
                first += 1
            for i in range(first, j):
                if previous[i] == infinity or (must_start and any(k in must_start for k in range(i + 1, j))):
                    continue
                value = max(previous[i], prefix_time[j] - prefix_time[i])
                if value < row[j]:
                    row[j], cut_row[j] = value, i
    if best[stages][n] == infinity:
        return None
    bounds = []
    end = n
    for s in range(stages, 0, -1):
        start = cut[s][end]
        bounds.append((start, end))
        end = start
    return bounds[::-1]


def bottleneck_s(costs: list[UnitCost], bounds: list[tuple[int, int]]) -> float:
    return max(sum(c.time_s for c in costs[start:end]) for start, end in bounds)
