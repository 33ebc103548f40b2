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
per parameter (fp32 and its bf16 copy), the moments, and fp32 gradients where micro-batches
accumulate them (`unsharded_state_bytes_per_param`); each op's saved bytes at autocast's dtypes
(`OpFacts.autocast_saved_bytes`: the fp32 residual at twice its traced bytes, each projection's
16-bit cast, where the evaluator counts one per module under the module rules: over, on the safe
side), autocast's 40/32 on the traced bytes where the evaluator does not count them op by op,
or min-cut's for a stage compiled whole (`activation_terms`); the buffers beside them
(`buffer_bytes`); and the allocator's slack on all of it (`memory.fragmentation`). The evaluator's
peak is the larger of the backward's (states and activations) and the optimizer step's (states and
temporaries, no activations); the row charges the larger states beside the activations, one row for
both: where the step's states are the larger (one micro-batch; foreach's temporaries) that is 2 B per
parameter more than the evaluator, on the safe side. Until the eleventh session the ILP charged the
traced bytes, 16 B per parameter and a 5% margin, so it could fit a layer the evaluator then found
too large.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import ClusterSpec
from autopar.plan_schema import Strategy
from autopar.cost_models.context import replicas
from autopar.cost_models.facts import ModelFacts
from autopar.cost_models.compiled_stage import compiled_layers
from autopar.cost_models.memory import (DDP_BUCKET_BYTES, OFFLOAD_STAGING_BYTES_PER_PARAM, activation_factor,
                                        autocast_states, fragmentation, model_state_bytes, planning_capacity_bytes,
                                        state_bytes_per_param as memory_state_bytes_per_param,
                                        unsharded_state_bytes_per_param, unsharded_states)
from autopar.cost_models.pipeline import estimate
from autopar.cost_models.stage_costs import counts_autocast_activations
from autopar.cost_models.strategy import even_stage_layers


@dataclass(frozen=True)
class LayerBudget:
    bytes: float  # per layer, per rank
    param_state_multiplier: float  # state bytes per traced weight byte
    activation_multiplier: float  # micro-batches whose activations a layer holds at the peak, × the factor
    autocast_saved: bool = False  # each op's saved bytes at autocast's dtypes (`OpFacts.autocast_saved_bytes`)


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
    capacity = plan_capacity_bytes(cluster, s) - buffer_bytes(facts, s)
    factor, counted = activation_terms(facts, s)
    held = 0.0
    if s.recompute == "none":
        ones = [1.0] * stages
        peak = estimate(ones, ones, s.num_microbatches, s.schedule, pp=s.pp, vp=s.vp, stage_weight=ones)
        held = max(peak.peak_in_flight) / s.vp * factor  # per chunk: a layer sits in one of the rank's vp chunks
    return LayerBudget(bytes=max(capacity - others, 0.0) / per_rank,
                       param_state_multiplier=state / weight_bytes, activation_multiplier=held, autocast_saved=counted)


def activation_terms(facts: ModelFacts, strategy: Strategy) -> tuple[float, bool]:
    """(device bytes per activation byte priced, whether the bytes are autocast's, op by op), as the
    evaluator counts a rank's activations (`memory.activation_factor`): autocast's dtypes where it counts
    them (`stage_costs.counts_autocast_activations`), its measured 40/32 on the traced bytes where it
    does not (`weight_passes=false`), min-cut's for a stage compiled whole; the allocator's margin apart."""
    s = strategy
    counted = counts_autocast_activations(facts, s)
    return activation_factor(facts.precision, s.zero, s.offload, s.optimizer_state, compiled_layers(s), counted), counted


def buffer_bytes(facts: ModelFacts, strategy: Strategy) -> float:
    """What a rank holds beside its states and activations, as `memory.device_memory` counts it: ZeRO-3's
    gathered unit and the next (the model's largest unit), else data parallelism's two gradient buckets.
    Expert and context parallelism's exchange buffers are left to the evaluator."""
    s = strategy
    if s.zero >= 3:
        largest = max((u.params_on_device(s.tp) for u in facts.units), default=0.0)
        gathered = 2 * largest * memory_state_bytes_per_param(facts.precision, s.optimizer_state).weight
        if s.offload == "optimizer":
            gathered += largest / replicas(s) * OFFLOAD_STAGING_BYTES_PER_PARAM
        return gathered
    return 2 * DDP_BUCKET_BYTES if replicas(s) > 1 else 0.0


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
