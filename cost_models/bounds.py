"""A floor under the quick estimate's step time, shared by every strategy that differs only in what
the floor leaves out.

`evaluate(..., exact=False)` prices a stage's forward as its units' compute plus their tensor-parallel
collectives plus terms that are never negative (the vocabulary-parallel head's collectives, ZeRO-3's
exposed gathers, MoE all-to-alls, the context exchange, the per-micro-batch weight passes), and its backward likewise plus the recompute;
the step is the closed-form pipeline estimate of those stage times (`pipeline.estimated_step_s`, whose
arithmetic is non-decreasing in every stage time) plus each rank's tail (gradient sync, optimizer step,
offload copies: never negative). The compute and the tp collectives of a unit do not depend on its
recompute policy, so the same estimate of the stages without the other terms is a floor under the
step of the strategy whatever its ZeRO stage, recompute policy and per-stage recompute counts, expert
parallel degree, cp kind, offload or weight passes (`cost_models.weight_passes`): the searcher skips what cannot rank (`searcher.bounded`).
Floating point keeps it a floor: each term is summed as `price_stages` sums it, and rounding is monotone.

Likewise a floor under each pipeline rank's peak memory: its model states and buffers with no
activations (`memory.device_memory` grows with each of its inputs), from the parameters the rank holds,
added up in `price_stages`' order. A strategy whose floor exceeds the capacity fits under no recompute
policy or counts (`evaluate` fits only when every rank's peak is within it).
"""

from __future__ import annotations

import dataclasses

from autopar.cluster import ClusterSpec
from autopar.plan_schema import Strategy, stage_rank
from autopar.cost_models.collectives import tied_across_ranks
from autopar.cost_models.communication import group_layout
from autopar.cost_models.compute import DEFAULT_EFFICIENCY, Efficiency
from autopar.cost_models.context import replicas, sync_layout
from autopar.cost_models.memory import device_memory
from autopar.cost_models.evaluate import priced_stages, stage_transfer_s
from autopar.cost_models.facts import ModelFacts, Unit
from autopar.cost_models.pipeline import estimated_step_s
from autopar.cost_models.stage_costs import CostCache, Pricing, part_token, unit_part

# The strategy keys the floor does not read: strategies equal but for these share one floor (priced at
# these values; `sp_inputs=regathered` only adds collectives to the gathered inputs' passes).
FLOOR_FREE_KEYS = {"zero": 0, "recompute": "none", "recompute_layers": None, "ep": 1, "cp_kind": "ring",
                   "offload": "none", "optimizer_state": "fp32", "optimizer_impl": "fused", "dp_overlap": True,
                   "zero3_fetch": "unit", "weight_passes": True, "sp_inputs": "gathered"}


def stage_pass_floors_s(pricing: Pricing, stages_units: list[list[Unit]]
                        ) -> tuple[list[float], list[float], list[float]]:
    """Per stage and micro-batch: (forward, backward) with only the units' compute and tp collectives,
    and the weight-gradient part of backward, each summed in `price_stages`' order."""
    token = part_token(pricing, "none")
    units = [unit for stage in stages_units for unit in stage]
    forward, backward, forward_comm, backward_comm, weight = pricing.cache.of_units(
        ("unit pass floors", token), units, lambda: _unit_pass_floors(pricing, units))
    forward_s, backward_s, weight_s = [], [], []
    start = 0
    for stage in stages_units:
        end = start + len(stage)  # a slice sums left to right, as a stage's parts are summed
        forward_s.append(sum(forward[start:end]) + sum(forward_comm[start:end]))
        backward_s.append(sum(backward[start:end]) + sum(backward_comm[start:end]))
        weight_s.append(sum(weight[start:end]))
        start = end
    return forward_s, backward_s, weight_s


def _unit_pass_floors(pricing: Pricing, units: list[Unit]) -> tuple[list[float], ...]:
    """Per unit: forward, backward, their tp collectives and the weight-gradient part (`unit_part`),
    each the smaller of the unit priced with and without autocast's bytes: whether autocast runs
    depends on keys the floor leaves out (ZeRO, offload, weight passes), and it can move fewer bytes
    for an op (a model's own cast to fp32 is no kernel when the value is fp32 already)."""
    pricings = [dataclasses.replace(pricing, autocast=flag) for flag in (False, True)]
    parts = [[unit_part(p, unit, "none", part_token(p, "none")) for unit in units] for p in pricings]
    weights = [[p.timed(unit).backward_weight_s for unit in units] for p in pricings]

    def least(values: list[list[float]]) -> list[float]:
        return [min(pair) for pair in zip(*values)]

    return tuple(least([[getattr(part, name) for part in each] for each in parts])
                 for name in ("forward_s", "backward_s", "forward_comm_s", "backward_comm_s")) + (least(weights),)


def quick_step_floor_s(facts: ModelFacts, cluster: ClusterSpec, strategy: Strategy, *,
                       stages: list[list[Unit]] | None = None, efficiency: Efficiency = DEFAULT_EFFICIENCY,
                       cache: CostCache | None = None) -> float:
    """At most the step time `evaluate(facts, cluster, s, ..., exact=False, stages=stages)` predicts for
    any strategy `s` equal to `strategy` but for `FLOOR_FREE_KEYS` (and any head vocabulary)."""
    s = strategy
    facts, stages_units = priced_stages(facts, s, stages)
    pricing = Pricing(facts=facts, cluster=cluster, strategy=s, efficiency=efficiency, cache=cache or CostCache(),
                      tp_layout=group_layout(s.tp, 1, cluster.gpus_per_node),
                      dp_layout=sync_layout(s, cluster.gpus_per_node))
    forward_s, backward_s, weight_s = stage_pass_floors_s(pricing, stages_units)
    return estimated_step_s(forward_s, backward_s, s.num_microbatches, s.schedule, pp=s.pp, vp=s.vp,
                            p2p_s=stage_transfer_s(s, cluster, stages_units), weight_s=weight_s)


def rank_params_on_device(stages_units: list[list[Unit]], strategy: Strategy) -> list[float]:
    """Per pipeline rank: the parameters it holds without ep (tp-local, a tied head's copy of the
    embedding included), added up as `evaluate` adds them."""
    s = strategy
    params = [0.0] * s.pp
    for index, units in enumerate(stages_units):
        rank = stage_rank(index, s.pp, s.schedule)
        for unit in units:
            params[rank] += unit.params_on_device(s.tp)  # as `price_stages` adds them at ep = 1
    for rank, tied in enumerate(tied_across_ranks(stages_units, s.pp, s.tp, s.schedule)):
        params[rank] += sum(elements for _, elements in tied["copies"])
    return params


def peak_memory_floor_bytes(precision: str, strategy: Strategy, rank_params: list[float]) -> float:
    """At most the largest peak over pipeline ranks `evaluate` predicts for `strategy` under any recompute
    policy and counts, given `rank_params_on_device`; 0 (no floor) under ep or offload, not bounded here."""
    s = strategy
    if s.ep > 1 or s.offload != "none":
        return 0.0
    # the states grow with the parameters: the rank holding the most has the largest floor
    return device_memory(params_on_device=max(rank_params), largest_unit_params=0.0, precision=precision, zero=s.zero,
                         dp=replicas(s), activation_bytes=0.0, optimizer_state=s.optimizer_state, offload=s.offload,
                         expert_dp=s.dp // s.ep, num_microbatches=s.num_microbatches, optimizer_impl=s.optimizer_impl,
                         pp=s.pp).total_bytes
