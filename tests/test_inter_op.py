"""Inter-op partitioning: the dynamic program against brute force over all contiguous cuts."""

import itertools
import random

import pytest

from autopar.searcher.inter_op import UnitCost, bottleneck_s, in_flight, partition


def brute_force(costs, stages, m, schedule, capacity):
    n = len(costs)
    best, best_bounds = float("inf"), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        edges = (0, *cuts, n)
        bounds = list(zip(edges, edges[1:]))
        ok = True
        for s, (a, b) in enumerate(bounds):
            seg = costs[a:b]
            memory = (sum(c.state_bytes for c in seg) + in_flight(s, stages, m, schedule) *
                      sum(c.activation_bytes for c in seg) + max(c.transient_bytes for c in seg))
            if capacity is not None and memory > capacity:
                ok = False
        if ok and bottleneck_s(costs, bounds) < best:
            best, best_bounds = bottleneck_s(costs, bounds), bounds
    return best, best_bounds


@pytest.mark.parametrize("seed", range(8))
def test_dp_matches_brute_force(seed):
    rng = random.Random(seed)
    n, stages = rng.randint(4, 9), rng.randint(2, 4)
    costs = [UnitCost(rng.uniform(0.5, 3.0), rng.uniform(1, 4), rng.uniform(0.1, 1), rng.uniform(0, 0.5))
             for _ in range(n)]
    capacity = rng.choice([None, 12.0, 20.0])
    expected, _ = brute_force(costs, stages, 8, "1f1b", capacity)
    bounds = partition(costs, stages, num_microbatches=8, memory_capacity_bytes=capacity)
    if expected == float("inf"):
        assert bounds is None
    else:
        assert bounds is not None and bottleneck_s(costs, bounds) == pytest.approx(expected)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a < b for a, b in bounds)


def test_heavy_head_gets_a_short_last_stage():
    # Embedding, 8 equal layers, then a head that costs as much as 3 layers (a large vocabulary).
    costs = [UnitCost(0.2, 1, 1)] + [UnitCost(1.0, 1, 1)] * 8 + [UnitCost(3.0, 1, 1)]
    bounds = partition(costs, 4, num_microbatches=8)
    last_layers = bounds[-1][1] - bounds[-1][0] - 1
    assert last_layers <= 1 and bottleneck_s(costs, bounds) <= 3.2


def test_memory_pushes_layers_to_later_stages():
    # The first stage holds the most micro-batches in flight (1F1B), so it must take fewer layers.
    costs = [UnitCost(1.0, 1.0, 2.0)] * 8
    free = partition(costs, 2, num_microbatches=8)
    tight = partition(costs, 2, num_microbatches=8, memory_capacity_bytes=16.0)
    assert free == [(0, 4), (4, 8)]
    assert tight == [(0, 3), (3, 8)]  # stage 0: 3 + 2 in flight × 6 = 15; stage 1: 5 + 1 × 10 = 15


def test_infeasible_and_degenerate():
    costs = [UnitCost(1.0, 10.0, 1.0)] * 3
    assert partition(costs, 2, num_microbatches=4, memory_capacity_bytes=5.0) is None
    assert partition(costs, 4, num_microbatches=4) is None  # more stages than units
    assert partition(costs, 3, num_microbatches=4) == [(0, 1), (1, 2), (2, 3)]
