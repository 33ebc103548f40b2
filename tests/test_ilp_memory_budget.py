"""The search gives the intra-op ILP each layer's share of device memory: when the fastest sharding
of a layer overflows it, the proposal is the fastest sharding that fits."""

import pytest

from autopar.cluster import load_cluster
from autopar.plan_schema import Strategy
from autopar.cost_models.compute import DEFAULT_EFFICIENCY
from autopar.cost_models.memory import RESERVED_BYTES, fragmentation, usable_bytes
from autopar.runtime.tensor_parallel.realization import capabilities_for
from autopar.searcher.memory_budget import layer_budget
from autopar.searcher.refiner import Refiner

pytest.importorskip("ortools")

BATCH = 8
STRATEGY = Strategy(dp=2, tp=2, pp=1, microbatch=2, num_microbatches=2)


@pytest.fixture(scope="module")
def tiny(gpt_256):
    return gpt_256


def refiner(spec, graph, facts, cluster):
    return Refiner(graph, facts, cluster, BATCH, DEFAULT_EFFICIENCY, True, {}, capabilities_for(spec.module))


def layer_weights(proposed):
    return {name: options for name, options in proposed.items()
            if name.startswith("layers.") and name.endswith(".weight") and ".ln" not in name}


def cluster_with_layer_budget(facts, budget_bytes):
    """A one-node cluster whose per-layer budget under STRATEGY is `budget_bytes` (no planner
    headroom: the budget is what the layer may use)."""
    reference = load_cluster("dgx-h100", gpus=4).model_copy(update={"memory_headroom": 0.0})
    ref = layer_budget(facts, reference, STRATEGY, 2)
    layers_per_rank = len(facts.layer_units)
    margin = fragmentation(STRATEGY.zero, STRATEGY.offload, STRATEGY.optimizer_state)
    fixed_costs = usable_bytes(reference.gpu.memory_bytes) / (1 + margin) - ref.bytes * layers_per_rank
    capacity = (budget_bytes * layers_per_rank + fixed_costs) * (1 + margin) + RESERVED_BYTES
    gpu = reference.gpu.model_copy(update={"memory_bytes": int(capacity)})
    return reference.model_copy(update={"gpu": gpu})


def test_a_tight_layer_budget_makes_the_ilp_shard_what_it_would_replicate(tiny):
    spec, graph, facts = tiny
    roomy = refiner(spec, graph, facts, load_cluster("dgx-h100", gpus=4))
    _, free = roomy.proposals(STRATEGY)
    weights = layer_weights(free)
    assert weights and all(options == ["R"] for options in weights.values())  # tiny layer: replication is fastest
    assert roomy.ilp_budgeted == 0

    budget = layer_budget(facts, load_cluster("dgx-h100", gpus=4), STRATEGY, 2)
    layer = facts.units[facts.layer_units[0]]
    replicated = layer.params * 2 * budget.param_state_multiplier  # parameters alone, every weight replicated
    tight_cluster = cluster_with_layer_budget(facts, 0.8 * replicated)
    tight = refiner(spec, graph, facts, tight_cluster)
    assert layer_budget(facts, tight_cluster, STRATEGY, 2).bytes == pytest.approx(0.8 * replicated, rel=1e-6)
    _, fitted = tight.proposals(STRATEGY)
    assert tight.ilp_budgeted >= 1
    sharded = [name for name, options in layer_weights(fitted).items() if options != ["R"]]
    assert sharded, layer_weights(fitted)


def test_the_search_reports_its_budgeted_solves(tiny):
    from autopar.searcher.search import search

    spec, graph, facts = tiny
    budget = layer_budget(facts, load_cluster("dgx-h100", gpus=4), STRATEGY, 2)
    layer = facts.units[facts.layer_units[0]]
    cluster = cluster_with_layer_budget(facts, 0.8 * layer.params * 2 * budget.param_state_multiplier)
    fixed = {"dp": 2, "tp": 2, "pp": 1, "microbatch": 2, "zero": 0, "recompute": "none", "sp": False}
    result = search(graph, facts, cluster, BATCH, fixed=fixed, capabilities=capabilities_for(spec.module))
    assert result.ilp_budgeted >= 1


def test_an_impossible_budget_keeps_the_fastest_sharding(tiny):
    """Nothing fits the share: the proposal stands unconstrained (the evaluator then judges the plan)."""
    spec, graph, facts = tiny
    impossible = refiner(spec, graph, facts, cluster_with_layer_budget(facts, 1.0))
    _, proposed = impossible.proposals(STRATEGY)
    assert impossible.ilp_budgeted >= 1
    assert all(options == ["R"] for options in layer_weights(proposed).values())


def test_the_layer_budget_charges_what_the_evaluator_counts(tiny):
    """Without ZeRO the runtime runs autocast over fp32 weights: the ILP's row charges each weight what
    the evaluator's peak holds per parameter, each op's activations at autocast's dtypes, and the
    allocator's slack on everything; under ZeRO 3 the states FSDP2 shards, the traced (16-bit)
    activations, and its gathered units beside them."""
    from autopar.cost_models.memory import (UNSHARDED_ALLOCATOR_SLACK, FRAGMENTATION_MARGIN, model_state_bytes,
                                            planning_capacity_bytes)

    _, _, facts = tiny
    cluster = load_cluster("dgx-h100", gpus=4)
    capacity = planning_capacity_bytes(cluster.gpu.memory_bytes, cluster.memory_headroom)
    layers = len(facts.layer_units)
    unsharded = layer_budget(facts, cluster, STRATEGY, 2)
    # two micro-batches: fp32 weights, their bf16 copies, accumulated fp32 gradients, moments = 18 B
    assert unsharded.param_state_multiplier == pytest.approx(18 / 2)
    assert unsharded.autocast_saved and unsharded.activation_multiplier == pytest.approx(1.0)  # one in flight
    assert unsharded.bytes * layers < capacity / (1 + UNSHARDED_ALLOCATOR_SLACK)

    sharded_states = STRATEGY.model_copy(update={"zero": 3})
    zero3 = layer_budget(facts, cluster, sharded_states, 2)
    assert zero3.param_state_multiplier == pytest.approx(
        sum(model_state_bytes(1.0, "bf16", 3, STRATEGY.dp, num_microbatches=2)) / 2)
    assert not zero3.autocast_saved and zero3.activation_multiplier == pytest.approx(1.0)
    gathered = 2 * max(u.params_on_device(2) for u in facts.units) * 2  # this unit and the next, bf16
    assert zero3.bytes * layers < capacity / (1 + FRAGMENTATION_MARGIN) - gathered

    untouched = layer_budget(facts, cluster, STRATEGY.model_copy(update={"weight_passes": False}), 2)
    assert not untouched.autocast_saved  # autocast's 40/32 on the traced bytes, as the evaluator prices it
    assert untouched.activation_multiplier == pytest.approx(40 / 32)


def test_the_ilp_s_memory_row_is_the_evaluator_s_count_of_its_sharding(tiny):
    """Solved with autocast's saved bytes, the ILP's activation row for the sharding it picks equals what
    the evaluator counts for that sharding (`unit_activation_bytes` over the solution's ops, at autocast's
    dtypes): the same ops, each divided over tp where the ILP shards its output."""
    from autopar.cost_models.stage_costs import unit_activation_bytes
    from autopar.searcher.intra_op import solve_unit

    _, graph, facts = tiny
    cluster = load_cluster("dgx-h100", gpus=4)
    layer = facts.units[facts.layer_units[0]]
    def solved(autocast_saved, budget):
        return solve_unit(layer, graph, tp=2, batch=STRATEGY.microbatch, cluster=cluster, dtype="bf16",
                          memory_budget_bytes=budget, autocast_saved=autocast_saved)

    for autocast_saved in (False, True):
        replicated = solved(autocast_saved, 1e15)  # the fastest: this small layer replicated
        tight = solved(autocast_saved, 0.7 * replicated.memory_bytes)  # sharded to fit
        assert any(op.saved_sharded for op in tight.ops if op.saved_bytes)
        for solution in (replicated, tight):
            counted = unit_activation_bytes(solution.unit, STRATEGY.microbatch, 2, False, "none",
                                            autocast=autocast_saved)
            assert solution.memory_bytes - solution.parameter_bytes == pytest.approx(counted)
    traced = unit_activation_bytes(tight.unit, STRATEGY.microbatch, 2, False, "none")
    assert counted > 1.2 * traced  # the fp32 residual and the 16-bit casts


def test_a_layer_that_fits_in_traced_bytes_but_not_at_autocast_s_is_sharded(tiny):
    """A budget between the replicated layer's traced activations and autocast's: the ILP must shard
    (here activations; weights would cost more than this budget asks)."""
    from autopar.cost_models.stage_costs import unit_activation_bytes
    from autopar.searcher.intra_op import solve_unit

    spec, graph, facts = tiny
    cluster = load_cluster("dgx-h100", gpus=4)
    budget = layer_budget(facts, cluster, STRATEGY, 2)
    layer = facts.units[facts.layer_units[0]]
    free = refiner(spec, graph, facts, cluster)
    fastest, _ = free._solved(solve_unit, (layer.layer_type, STRATEGY.tp, STRATEGY.microbatch), layer, STRATEGY, None)
    params = fastest.parameter_bytes * budget.param_state_multiplier
    traced, counted = (unit_activation_bytes(fastest.unit, STRATEGY.microbatch, STRATEGY.tp, False, "none",
                                             autocast=a) for a in (False, True))
    between = params + (traced + counted) / 2
    assert params + traced < between < params + counted
    free_ops, _ = free.proposals(STRATEGY)
    tight = refiner(spec, graph, facts, cluster_with_layer_budget(facts, between))
    tight_ops, _ = tight.proposals(STRATEGY)
    assert tight.ilp_budgeted >= 1
    assert [name for name in free_ops if tight_ops.get(name) != free_ops[name]]  # ops of the layer, sharded


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("changes", [dict(), dict(weight_passes=False), dict(zero=1), dict(zero=3)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_the_partition_weighs_each_rank_as_the_evaluator_does(tiny, monkeypatch, recompute, changes):
    """On the even split, each pipeline rank's bytes as the partition weighs them (its units' states,
    the tied head's copy of the embedding, activations of the micro-batches in flight, the largest
    transient or the loss's gradients, against capacity less the buffers) are the evaluator's peak for
    that rank, its allocator margin apart: full recompute keeps a layer's fp32 input under autocast
    (twice its traced bytes), not the no-recompute ratio."""
    import autopar.searcher.refiner as refiner_module
    from autopar.cost_models.evaluate import evaluate, partition as even_partition
    from autopar.cost_models.pipeline import estimate
    from autopar.searcher.memory_budget import buffer_bytes

    spec, graph, facts = tiny
    cluster = load_cluster("dgx-h100", gpus=4)
    s = Strategy(dp=2, tp=1, pp=2, microbatch=1, num_microbatches=4, recompute=recompute, **changes)
    captured = {}
    monkeypatch.setattr(refiner_module, "dp_partition", lambda costs, *a, **k: captured.update(costs=costs))
    refiner(spec, graph, facts, cluster)._partition(facts, s)
    costs = dict(zip((u.name for u in facts.units), captured["costs"]))
    stages = even_partition(facts, s.pp)
    weights = [sum(costs[u.name].activation_bytes for u in stage) for stage in stages]
    ones = [1.0] * s.pp
    pipe = estimate(ones, ones, s.num_microbatches, s.schedule, pp=s.pp, vp=1, stage_weight=ones)  # in flight
    evaluation = evaluate(facts, cluster, s, BATCH, stages=stages)
    for rank, stage in enumerate(stages):
        weighed = (sum(costs[u.name].state_bytes for u in stage) + pipe.peak_in_flight[rank] * weights[rank]
                   + max(costs[u.name].transient_bytes for u in stage) + buffer_bytes(facts, s))
        peak = evaluation.memory[rank]
        # the allocator's margin apart: without ZeRO a slack on all of it, with ZeRO on what churns
        held = peak.total_bytes / (1 + fragmentation(s.zero, s.offload, s.optimizer_state)) if s.zero == 0 \
            else peak.total_bytes - peak.margin
        # ZeRO-3's gathered units are the model's largest, wherever they sit: never below the evaluator
        assert held * (1 - 1e-9) <= weighed <= 1.04 * held, (rank, changes, weighed, held)
