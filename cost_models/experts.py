"""Expert parallelism (ep): what sharding a MoE model's experts over ep ranks costs and sends.

ep shares ranks with dp, as Megatron-LM and DeepSpeed-MoE run it: the dp ranks form groups of ep
consecutive ranks (stride tp), each holding E/ep of every MoE layer's experts; the dp/ep groups
holding the same experts are its replicas. Per MoE layer and micro-batch, as `runtime.expert_parallel`
runs it:
- forward: a dispatch all-to-all (every rank's [E, b·C, hidden] buffer, each expert's rows to the
  rank holding it) and a combine all-to-all back, each moving b × `dispatch_bytes_per_sample`;
- backward: the same two, transposed; full recompute repeats the forward's two;
- the all-to-all is priced on the ep group's layout (NVLink inside a node, the network's share across
  nodes: `communication.collective_time_s`), exposed (not overlapped with compute), and scaled by the
  load-imbalance factor.
Compute: unchanged by ep. The graph already holds the experts' GEMMs over E × C slots per sequence
(the capacity pads every queue), and each rank runs E/ep experts on ep times the rows.
Memory: expert parameters, their gradients and optimizer states divided by ep; the dispatch
buffers (one all-to-all's send and receive buffers in flight); the received rows that backward
keeps are what the graph saves at ep = 1 (the same [E, b·C, hidden] per layer), so activations stay.
Gradients: non-expert parameters reduced over dp as before; expert gradients only over their
dp/ep replicas (nothing when ep = dp), since the all-to-all's backward already summed the ep group's.
ZeRO (expert data parallelism, as Megatron-LM and TorchTitan shard MoE experts): non-expert states
are sharded over dp as without ep; each rank's E/ep expert slices are an FSDP unit of their own,
sharded over their dp/ep replicas ("edp", `replica_layout`), so ZeRO 1/2/3 divide expert states by
ep × dp/ep = dp, and the experts' all-gathers and reduce-scatters run on the edp groups (none when
ep = dp). A slice is sharded on its first dimension when the replicas divide its E/ep experts, else
on the first dimension they divide (TorchTitan's rule: Mixtral's one expert per rank over 8 replicas
would otherwise be padded 8-fold), see `expert_shard_dim`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.cluster import ClusterSpec
from autopar.cost_models.communication import GroupLayout, collective_time_s, group_layout
from autopar.graph.ir import DTYPE_BYTES
from autopar.plan_schema import Strategy

# The busiest ep rank's all-to-all traffic over the mean. 1.0: balanced, which is exact for the zoo's
# MoE (every expert's queue is padded to its capacity, so each rank sends and receives the same
# rows whatever the routing: imbalance drops tokens instead of slowing the step). A dropless router
# (Mixtral, MegaBlocks) sends what the routing gives: price it with a measured ratio above 1.
LOAD_IMBALANCE = 1.0
ALL_TO_ALLS_PER_PASS = 2  # dispatch and combine
_ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer, in the cost model's terms."""

    unit: str  # the pipeline unit (layer instance) holding it
    experts: int
    expert_params: int  # elements of its experts' weights
    dispatch_bytes_per_sample: float  # one all-to-all's buffer for one sample
    autopar_dispatch: bool  # the zoo's MoE, which the runtime shards over ep
    param_shapes: tuple[tuple[int, ...], ...] = ()  # each expert weight's full shape, [E, ...]


def expert_layers(graph, unit_of: dict[str, str]) -> tuple[ExpertLayer, ...]:
    """The graph's MoE layers (`graph.moe_layers`) with the unit whose forward runs each router."""
    activation = DTYPE_BYTES.get({"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(graph.precision,
                                                                                               "float32"), 4)
    shapes = {p.name: tuple(p.shape) for p in graph.params}
    layers = []
    for layer in graph.moe_layers:
        prefix = layer.module_path + "."
        unit = next((unit_of[n.name] for n in graph.nodes if n.phase == "forward"
                     and (n.module_path + ".").startswith(prefix)), None)
        if unit is None:
            continue
        layers.append(ExpertLayer(unit=unit, experts=layer.experts, expert_params=layer.expert_param_elements,
                                  dispatch_bytes_per_sample=float(layer.dispatch_rows_per_sample * layer.hidden
                                                                  * activation),
                                  autopar_dispatch=layer.autopar_dispatch,
                                  param_shapes=tuple(shapes[n] for n in layer.expert_params if n in shapes)))
    return tuple(layers)


def all_to_all_axis(strategy: Strategy) -> str:
    """The mesh axis the all-to-all runs on: the dp communicator itself when ep = dp, else the ep groups."""
    return "dp" if strategy.ep == strategy.dp else "ep"


def ep_layout(strategy: Strategy, gpus_per_node: int) -> GroupLayout:
    return group_layout(strategy.ep, strategy.tp, gpus_per_node)


def replica_layout(strategy: Strategy, gpus_per_node: int) -> GroupLayout:
    """The dp/ep ranks holding the same experts: ep × tp apart."""
    return group_layout(strategy.dp // strategy.ep, strategy.ep * strategy.tp, gpus_per_node)


def expert_shard_dim(local_shape: Sequence[int], replicas: int) -> int:
    """The dimension FSDP2 shards a rank's expert slice on over its `replicas`: the first (experts)
    when they divide it, else the first they divide (no padding), else the first, padded."""
    if not local_shape or local_shape[0] % replicas == 0:
        return 0
    return next((d for d, size in enumerate(local_shape) if size % replicas == 0), 0)


def fsdp_expert_elements(layers: Sequence[ExpertLayer], unit: str, ep: int, replicas: int) -> float:
    """Elements one all-gather (or reduce-scatter) of `unit`'s expert slices moves over their replicas:
    each [E/ep, ...] slice, padded on its first dimension when that is what FSDP2 shards and the
    replicas do not divide it."""
    total = 0.0
    for layer in layers:
        if layer.unit != unit:
            continue
        for shape in layer.param_shapes:
            local = (shape[0] // ep, *shape[1:])
            rows = -(-local[0] // replicas) * replicas if expert_shard_dim(local, replicas) == 0 else local[0]
            total += rows * math.prod(local[1:])
    return total


def unit_all_to_alls(layers: Sequence[ExpertLayer], unit: str, microbatch: int, policy: str
                     ) -> list[tuple[str, float, int]]:
    """(phase, bytes, calls) one micro-batch of `unit` sends: forward, backward, and recompute under
    full recompute."""
    result = []
    for layer in layers:
        if layer.unit != unit:
            continue
        size = layer.dispatch_bytes_per_sample * microbatch
        result += [("forward", size, ALL_TO_ALLS_PER_PASS), ("backward", size, ALL_TO_ALLS_PER_PASS)]
        if policy == "full":
            result.append(("recompute", size, ALL_TO_ALLS_PER_PASS))
    return result


def all_to_all_time_s(size: float, strategy: Strategy, cluster: ClusterSpec) -> float:
    return LOAD_IMBALANCE * collective_time_s("all_to_all", size, ep_layout(strategy, cluster.gpus_per_node), cluster)


def unit_expert_params(layers: Sequence[ExpertLayer], unit: str) -> int:
    return sum(layer.expert_params for layer in layers if layer.unit == unit)


def dispatch_buffer_bytes(layers: Sequence[ExpertLayer], units: Sequence[str], microbatch: int) -> float:
    """The send and receive buffers of one all-to-all in flight, the largest layer's, on a rank holding `units`."""
    sizes = [layer.dispatch_bytes_per_sample for layer in layers if layer.unit in set(units)]
    return 2 * microbatch * max(sizes) if sizes else 0.0


def fewest_experts(layers: Sequence[ExpertLayer]) -> int | None:
    return min((layer.experts for layer in layers), default=None)


def expert_parallel_refusal(layers: Sequence[ExpertLayer]) -> str | None:
    """Why the runtime cannot shard this model's experts (None: it can)."""
    if not layers:
        return "expert parallelism (ep > 1) needs mixture-of-experts layers; this model has none"
    if not all(layer.autopar_dispatch for layer in layers):
        return ("the runtime's expert parallelism runs the zoo's MoE block (autopar.models.moe, fixed-capacity "
                "dispatch); this model routes its own way: leave ep out")
    return None
