"""Each layer's share of device memory under a strategy: the budget of the intra-op ILP's memory row.

The evaluator checks a whole plan's memory; the ILP sees one layer. So that the sharding it
proposes for a layer type can fit, it gets the layer's share of the most loaded pipeline rank:
usable memory less the planner's headroom, the fragmentation margin, the data-parallel buffers
and the stage's non-layer units (embedding, head), divided by the layers the rank holds. Its memory row then counts, per
rank, parameters × the state bytes each weight byte brings under the ZeRO stage (weight, gradient,
optimizer) and saved activations × the micro-batches the first rank holds in flight (none under
recompute: a recomputed layer keeps its input only, which no sharding of the layer changes).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import ClusterSpec
from autopar.plan_schema import Strategy
from autopar.cost_models.context import replicas
from autopar.cost_models.facts import ModelFacts
from autopar.cost_models.memory import (DDP_BUCKET_BYTES, FRAGMENTATION_MARGIN, model_state_bytes,
                                        planning_capacity_bytes)
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
    state = sum(model_state_bytes(1.0, facts.precision, s.zero, replicas(s), pp=s.pp,
                                  num_microbatches=s.num_microbatches))  # bytes per parameter
    stages = s.pp * s.vp
    sizes = even_stage_layers(layers, stages) if stages <= layers + 2 else [1] * stages
    per_rank = max(sum(sizes[i] for i in range(rank, stages, s.pp)) for rank in range(s.pp))
    others = max(sum(u.params_on_device(s.tp) for u in facts.units if u.layer_type is None) * state, 0.0)
    buffers = 2 * DDP_BUCKET_BYTES if replicas(s) > 1 and s.zero < 3 else 0.0
    capacity = planning_capacity_bytes(cluster.gpu.memory_bytes, cluster.memory_headroom) / (1 + FRAGMENTATION_MARGIN)
    held = 0.0
    if s.recompute == "none":
        ones = [1.0] * stages
        peak = estimate(ones, ones, s.num_microbatches, s.schedule, pp=s.pp, vp=s.vp, stage_weight=ones)
        held = max(peak.peak_in_flight) / s.vp  # per chunk: a layer sits in one of the rank's vp chunks
    return LayerBudget(bytes=max(capacity - buffers - others, 0.0) / per_rank,
                       param_state_multiplier=state / weight_bytes, activation_multiplier=held)
