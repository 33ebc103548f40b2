"""The quick ranking, pricing only the completions that can matter to the search's answer.

`search` reads from the ranking of every valid completion (`candidates.quick_evaluations`) its first
`keep` by rank key, and, for the why-not rows, the best member of a few groups
(`why_not.compared_groups`; `why_not._best_of`: the fastest that fits, or the one closest to fitting
when none does). Every completion has a cheap floor under its quick step time
(`cost_models.bounds.quick_step_floor_s`, shared by the completions that differ only in ZeRO, recompute,
ep, ...) and one under its peak memory (`bounds.peak_memory_floor_bytes`: above the capacity, it fits
under no recompute). Completions are priced in the order of their floors, those that may fit first; one
is skipped only when its floors prove that it ranks after the `keep` best priced so far, all of which
fit (it does not fit, or is slower than the last of them), and that it cannot be the best of any group
it belongs to (the group has a fitting member priced, and it does not fit or is slower). Skipped
completions could therefore change neither the first `keep` of the ranking nor any group's best: the
search's answer is the one the full ranking gives (tests/test_bounded_search.py compares the two).
"""

from __future__ import annotations

import bisect
from operator import attrgetter
from typing import Any, Callable

from autopar.cluster import ClusterSpec
from autopar.plan_schema import Strategy
from autopar.cost_models.bounds import (FLOOR_FREE_KEYS, peak_memory_floor_bytes, quick_step_floor_s,
                                       rank_params_on_device)
from autopar.cost_models.compute import DEFAULT_EFFICIENCY, Efficiency
from autopar.cost_models.evaluate import Evaluation, partition
from autopar.cost_models.facts import ModelFacts
from autopar.cost_models.memory import planning_capacity_bytes
from autopar.cost_models.stage_costs import CostCache
from autopar.searcher.candidates import (evaluate_fitted, fit_recompute, keeps_some_shards, kept_shards, priced_as_run,
                                         shards_may_pay, valid_strategies)

# Step floors are lowered by this fraction before they are compared: insurance that no rounding can lift
# one above the step it bounds (they are summed as the evaluation sums, so none should).
FLOOR_SLACK = 1e-9


def bounded_quick_evaluations(
    facts: ModelFacts, cluster: ClusterSpec, fixed: dict[str, Any], global_batch: int, *, layers: int,
    rank_key: Callable[[Evaluation], tuple], keep: int, groups: list[Callable[[Strategy], bool]],
    efficiency: Efficiency = DEFAULT_EFFICIENCY, supports: Callable[[Strategy], str | None] | None = None,
    cache: CostCache | None = None, tp_realization: str | None = None,
) -> tuple[list[Evaluation], int, dict[str, int]]:
    """`quick_evaluations` (same arguments, same count and rejections, evaluations in enumeration order)
    less the completions that rank after the first `keep` by `rank_key` and that no group's best can be.
    `rank_key(e)[:2]` must be (False, round(e.step_time_s, 9)) for an `e` that fits, and start with True for
    one that does not (its order among those is free: the bound is compared only with a fitting `keep`-th)."""
    cache = cache if cache is not None else CostCache()
    facts = priced_as_run(facts, fixed)
    valid, count, rejected = valid_strategies(facts, cluster, fixed, global_batch, layers=layers, supports=supports)
    # each variant keeping sequence shards follows the completion it varies, `twin_of` it, with its floors
    # (`FLOOR_FREE_KEYS`), so it comes after it; priced only where `quick_evaluations` prices it
    twins = [j for j, s in enumerate(valid) if shards_may_pay(s, None, fixed)]
    twin_of = {len(valid) + k: j for k, j in enumerate(twins)}
    valid = valid + [kept_shards(valid[j]) for j in twins]
    floors = _floors(facts, cluster, valid, efficiency, cache)
    unfit = _cannot_fit(facts, cluster, valid)
    membership = [[g for g, member in enumerate(groups) if member(s)] for s in valid]
    best: list[tuple[tuple, int]] = []  # the `keep` smallest (rank key, position) priced so far
    group_best: list[float | None] = [None] * len(groups)  # per group, its fastest fitting step priced so far
    priced: dict[int, Evaluation] = {}
    for i in sorted(range(len(valid)), key=lambda i: (unfit[i], floors[i], i)):  # those that may fit first
        twin = twin_of.get(i)
        if twin is not None and (twin not in priced or not shards_may_pay(valid[twin], priced[twin], fixed)):
            continue  # its twin was skipped (so would it be: the same floors) or memory does not bind it
        floor, slower = floors[i], unfit[i]  # a plan that does not fit ranks after every one that does
        ranks = len(best) < keep or best[-1][0][0] or (not slower and round(floor, 9) <= best[-1][0][1])
        if not ranks and not any(group_best[g] is None or (not slower and floor <= group_best[g])
                                 for g in membership[i]):
            continue
        evaluation = evaluate_fitted(facts, cluster, valid[i], global_batch, exact=False, efficiency=efficiency,
                                     fit=fit_recompute(fixed), cache=cache, tp_realization=tp_realization)
        if twin is not None and not keeps_some_shards(evaluation, layers):
            continue
        priced[i] = evaluation
        bisect.insort(best, (rank_key(evaluation), i))
        del best[keep:]
        if evaluation.fits:
            for g in membership[i]:
                if group_best[g] is None or evaluation.step_time_s < group_best[g]:
                    group_best[g] = evaluation.step_time_s
    return [priced[i] for i in sorted(priced)], count, rejected


def _floors(facts: ModelFacts, cluster: ClusterSpec, strategies: list[Strategy], efficiency: Efficiency,
            cache: CostCache) -> list[float]:
    """Each strategy's floor (lowered by `FLOOR_SLACK`), computed once per group of strategies that share it."""
    stages_of: dict[int, list] = {}
    shared: dict[tuple, float] = {}
    floors = []
    floor_key = attrgetter(*_FLOOR_FIELDS)  # the fields the floor reads, in one call per strategy
    for s in strategies:
        key = floor_key(s)
        if key not in shared:
            count = s.pp * s.vp
            if count not in stages_of:
                stages_of[count] = partition(facts, count)
            shared[key] = quick_step_floor_s(facts, cluster, s.model_copy(update=FLOOR_FREE_KEYS),
                                             stages=stages_of[count], efficiency=efficiency,
                                             cache=cache) * (1 - FLOOR_SLACK)
        floors.append(shared[key])
    return floors


def _cannot_fit(facts: ModelFacts, cluster: ClusterSpec, strategies: list[Strategy]) -> list[bool]:
    """Whether each strategy's memory floor (`bounds.peak_memory_floor_bytes`) already exceeds the capacity."""
    capacity = planning_capacity_bytes(cluster.gpu.memory_bytes, cluster.memory_headroom)
    params_of: dict[tuple, list[float]] = {}
    floor_of: dict[tuple, float] = {}
    result = []
    for s in strategies:
        layout = (s.tp, s.pp, s.vp, s.schedule == "zbv")  # what the ranks' parameters depend on
        key = (layout, s.zero, s.dp, s.cp, s.ep, s.num_microbatches, s.optimizer_state, s.offload, s.optimizer_impl)
        if key not in floor_of:
            if layout not in params_of:
                params_of[layout] = rank_params_on_device(partition(facts, s.pp * s.vp), s)
            floor_of[key] = peak_memory_floor_bytes(facts.precision, s, params_of[layout])
        result.append(floor_of[key] > capacity)
    return result


_FLOOR_FIELDS = tuple(name for name in Strategy.model_fields if name not in FLOOR_FREE_KEYS)
