"""Each layer's share of device memory under a strategy: the budget of the intra-op ILP's memory row.

The evaluator checks a whole plan's memory; the ILP sees one layer. So that the sharding it
proposes for a layer type can fit, it gets the layer's share of the most loaded pipeline rank:
usable memory less the planner's headroom, the allocator's margin, the data-parallel buffers
and the stage's non-layer units (embedding, head), divided by the layers the rank holds. Its memory row then counts, per
rank, parameters × the state bytes each weight byte brings under the ZeRO stage (weight, gradient,
optimizer) and saved activations × the micro-batches the first rank holds in flight (none under
recompute: a recomputed layer keeps its input only, which no sharding of the layer changes).

Each term is the evaluator's (`cost_models.memory`), so that a sharding the ILP fits is one the plan's
memory check can accept. Without ZeRO that is the runtime's autocast over fp32 weights: 6 B of weight
per parameter (fp32 and its bf16 copy), the moments, the larger of the backward and optimizer-step
peaks (`unsharded_state_bytes_per_param`); the activations at autocast's dtypes, the model's own
ratio to the traced bytes (`ModelFacts.autocast_activation_factor`: a GPT layer 1.249, a Llama one
1.036) or min-cut's for a stage compiled whole; and the allocator's slack on all of it
(`memory.fragmentation`). Until the eleventh session the ILP charged the traced bytes and the ZeRO
states' 16 B, so it could fit a GPT layer the evaluator found 25% larger in activations.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import ClusterSpec
from autopar.plan_schema import Strategy
from autopar.cost_models.context import replicas
from autopar.cost_models.facts import ModelFacts
from autopar.cost_models.compiled_stage import compiled_layers
from autopar.cost_models.memory import (DDP_BUCKET_BYTES, activation_factor, autocast_states, fragmentation,
                                        model_state_bytes, planning_capacity_bytes, unsharded_state_bytes_per_param,
                                        unsharded_states)
from autopar.cost_models.pipeline import estimate
from autopar.cost_models.strategy import even_stage_layers


@dataclass(frozen=True)
class LayerBudget:
    bytes: float  # per layer, per rank
    param_state_multiplier: float  # state bytes per traced weight byte
    activation_multiplier: float  # micro-batches whose activations a layer holds at the peak


def layer_budget(facts: ModelFacts, cluster: ClusterSpec, strategy: Strategy, weight_bytes: int) -> LayerBudget | None:
    """None when the model has no layers. `weight_bytes`: bytes per element of the traced weights."""
    s = strategy
    layers = len(facts.layer_units)
    if not layers:
        return None
    state = state_bytes_per_param(facts, s)
    stages = s.pp * s.vp
    sizes = even_stage_layers(layers, stages) if stages <= layers + 2 else [1] * stages
    per_rank = max(sum(sizes[i] for i in range(rank, stages, s.pp)) for rank in range(s.pp))
    others = max(sum(u.params_on_device(s.tp) for u in facts.units if u.layer_type is None) * state, 0.0)
    buffers = 2 * DDP_BUCKET_BYTES if replicas(s) > 1 and s.zero < 3 else 0.0
    capacity = plan_capacity_bytes(cluster, s)
    held = 0.0
    if s.recompute == "none":
        ones = [1.0] * stages
        peak = estimate(ones, ones, s.num_microbatches, s.schedule, pp=s.pp, vp=s.vp, stage_weight=ones)
        # per chunk (a layer sits in one of the rank's vp chunks), at the bytes the runtime keeps
        held = max(peak.peak_in_flight) / s.vp * saved_bytes_per_traced_byte(facts, s)
    return LayerBudget(bytes=max(capacity - buffers - others, 0.0) / per_rank,
                       param_state_multiplier=state / weight_bytes, activation_multiplier=held)


def saved_bytes_per_traced_byte(facts: ModelFacts, strategy: Strategy) -> float:
    """What a layer keeps for backward per byte of its traced activations, as the evaluator counts it:
    autocast's dtypes (the model's ratio where its facts count one), min-cut's for a stage compiled whole."""
    s = strategy
    compiled = compiled_layers(s)
    counted = facts.autocast_activation_factor is not None and not compiled
    factor = activation_factor(facts.precision, s.zero, s.offload, s.optimizer_state, compiled, counted)
    if counted and autocast_states(facts.precision, s.zero, s.offload, s.optimizer_state):
        factor *= facts.autocast_activation_factor
    return factor


def state_bytes_per_param(facts: ModelFacts, strategy: Strategy) -> float:
    """Weight, gradient and optimizer bytes a rank holds per parameter of its share, as the evaluator's
    peak counts them: the runtime's autocast over fp32 weights without ZeRO, FSDP2's shards with it."""
    s = strategy
    if unsharded_states(s.zero, s.offload, s.optimizer_state):
        return unsharded_state_bytes_per_param(autocast_states(facts.precision, s.zero, s.offload, s.optimizer_state),
                                               s.num_microbatches, s.optimizer_impl)
    return sum(model_state_bytes(1.0, facts.precision, s.zero, replicas(s), s.optimizer_state, pp=s.pp,
                                 num_microbatches=s.num_microbatches))


def plan_capacity_bytes(cluster: ClusterSpec, strategy: Strategy) -> float:
    """What a rank's priced bytes may reach before the allocator's margin (`memory.fragmentation`)."""
    s = strategy
    return (planning_capacity_bytes(cluster.gpu.memory_bytes, cluster.memory_headroom)
            / (1 + fragmentation(s.zero, s.offload, s.optimizer_state)))
