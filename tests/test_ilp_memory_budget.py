"""The search gives the intra-op ILP each layer's share of device memory: when the fastest sharding
of a layer overflows it, the proposal is the fastest sharding that fits."""

import pytest

from autopar.cluster import load_cluster
from autopar.plan_schema import Strategy
from autopar.cost_models.compute import DEFAULT_EFFICIENCY
from autopar.cost_models.memory import RESERVED_BYTES, fragmentation, usable_bytes
from autopar.runtime.tensor_parallel.realization import capabilities_for
from autopar.searcher.memory_budget import layer_budget
from autopar.searcher.search import Refiner

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
    the evaluator's peak holds per parameter, the activations at autocast's dtypes, and the allocator's
    slack on everything; under ZeRO 3 the states FSDP2 shards and the traced (16-bit) activations."""
    from autopar.cost_models.memory import (UNSHARDED_ALLOCATOR_SLACK, FRAGMENTATION_MARGIN, model_state_bytes,
                                            planning_capacity_bytes)
    from autopar.cost_models.stage_costs import unit_kept_bytes

    _, _, facts = tiny
    cluster = load_cluster("dgx-h100", gpus=4)
    capacity = planning_capacity_bytes(cluster.gpu.memory_bytes, cluster.memory_headroom)
    assert facts.autocast_activation_factor > 1.1  # a GPT layer keeps its fp32 residual and 16-bit casts
    unsharded = layer_budget(facts, cluster, STRATEGY, 2)
    # two micro-batches: fp32 weights, their bf16 copies, accumulated fp32 gradients, moments = 18 B
    assert unsharded.param_state_multiplier == pytest.approx(18 / 2)
    layer = facts.units[facts.layer_units[0]]
    counted, traced = (unit_kept_bytes(layer, STRATEGY, "none", autocast=a)[0] for a in (True, False))
    assert counted / traced > 1.2  # the fp32 residual and the 16-bit casts, more where tp shards the rest
    assert unsharded.activation_multiplier == pytest.approx(counted / traced)  # one micro-batch in flight
    layers = len(facts.layer_units)
    assert unsharded.bytes * layers < capacity / (1 + UNSHARDED_ALLOCATOR_SLACK)

    sharded_states = STRATEGY.model_copy(update={"zero": 3})
    zero3 = layer_budget(facts, cluster, sharded_states, 2)
    assert zero3.param_state_multiplier == pytest.approx(
        sum(model_state_bytes(1.0, "bf16", 3, STRATEGY.dp, num_microbatches=2)) / 2)
    assert zero3.activation_multiplier == pytest.approx(1.0)
    assert zero3.bytes * layers < capacity / (1 + FRAGMENTATION_MARGIN)


def test_a_layer_that_fits_in_traced_bytes_but_not_at_autocast_s_is_sharded(tiny):
    """A budget between the replicated layer's traced activations and autocast's: the ILP must shard
    (here activations; weights would cost more than this budget asks)."""
    from autopar.searcher.intra_op import solve_unit

    spec, graph, facts = tiny
    cluster = load_cluster("dgx-h100", gpus=4)
    budget = layer_budget(facts, cluster, STRATEGY, 2)
    layer = facts.units[facts.layer_units[0]]
    free = refiner(spec, graph, facts, cluster)
    fastest, _ = free._solved(solve_unit, (layer.layer_type, STRATEGY.tp, STRATEGY.microbatch), layer, STRATEGY, None)
    params = fastest.parameter_bytes * budget.param_state_multiplier
    saved = fastest.memory_bytes - fastest.parameter_bytes  # traced, one micro-batch in flight
    between = params + saved * (1 + budget.activation_multiplier) / 2
    assert params + saved < between < params + saved * budget.activation_multiplier
    free_ops, _ = free.proposals(STRATEGY)
    tight = refiner(spec, graph, facts, cluster_with_layer_budget(facts, between))
    tight_ops, _ = tight.proposals(STRATEGY)
    assert tight.ilp_budgeted >= 1
    assert [name for name in free_ops if tight_ops.get(name) != free_ops[name]]  # ops of the layer, sharded


CASES = [dict(), dict(weight_passes=False), dict(compile=True, dp=1, tp=1), dict(zero=3),
         dict(microbatch=4, num_microbatches=1), dict(optimizer_impl="foreach")]


@pytest.mark.parametrize("changes", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_the_ilp_s_activation_ratio_is_the_evaluator_s(tiny, changes):
    """A layer without recompute: the traced bytes times the budget's ratio are what the evaluator keeps,
    its counted bytes times its activation factor (autocast's dtypes only where it counts them op by op:
    not with `weight_passes=false`; min-cut's for a stage compiled whole; none under ZeRO)."""
    from autopar.cost_models.compiled_stage import compiled_layers
    from autopar.cost_models.memory import activation_factor
    from autopar.cost_models.stage_costs import counts_autocast_activations, unit_kept_bytes
    from autopar.searcher.memory_budget import saved_bytes_per_traced_byte

    _, _, facts = tiny
    s = STRATEGY.model_copy(update=changes)
    counted = counts_autocast_activations(facts, s)
    layer = facts.units[facts.layer_units[0]]
    evaluator = unit_kept_bytes(layer, s, "none", None, counted)[0] * activation_factor(
        facts.precision, s.zero, s.offload, s.optimizer_state, compiled_layers(s), counted)
    traced = unit_kept_bytes(layer, s, "none", None, False)[0]
    assert traced * saved_bytes_per_traced_byte(facts, s) == pytest.approx(evaluator, rel=0.02)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("changes", [dict(), dict(weight_passes=False), dict(zero=1)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_the_partition_weighs_each_unit_as_the_evaluator_does(tiny, monkeypatch, recompute, changes):
    """The pipeline partition's per-unit bytes (kept, transient while recomputing, states) are the
    evaluator's for the same policy: full recompute keeps a layer's fp32 input under autocast (twice its
    traced bytes), not the no-recompute ratio, and the head its own."""
    import autopar.searcher.search as search_module
    from autopar.cost_models.evaluate import evaluate

    spec, graph, facts = tiny
    cluster = load_cluster("dgx-h100", gpus=4)
    s = Strategy(dp=1, tp=1, pp=2, microbatch=1, num_microbatches=4, recompute=recompute, **changes)
    captured = {}
    monkeypatch.setattr(search_module, "dp_partition", lambda costs, *a, **k: captured.update(costs=costs))
    refiner(spec, graph, facts, cluster)._partition(facts, s)
    evaluation = evaluate(facts, cluster, s, BATCH)
    scale = evaluation.activation_scale / (1 + fragmentation(s.zero, s.offload, s.optimizer_state))
    from autopar.cost_models.stage_costs import Pricing, CostCache, autocast_activations, unit_kept_bytes
    from autopar.cost_models.communication import group_layout
    pricing = Pricing(facts=facts, cluster=cluster, strategy=s, efficiency=DEFAULT_EFFICIENCY, cache=CostCache(),
                      tp_layout=group_layout(1, 1, 8), dp_layout=group_layout(1, 1, 8))
    for unit, cost in zip(facts.units, captured["costs"]):
        policy = recompute if unit.layer_type else "none"
        kept, transient = unit_kept_bytes(unit, s, policy, None, autocast_activations(pricing))
        assert cost.activation_bytes == pytest.approx(kept * scale), (unit.name, policy)
        assert cost.transient_bytes == pytest.approx(transient * scale), (unit.name, policy)
