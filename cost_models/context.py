"""Context parallelism (cp): what splitting each sequence over cp ranks costs, sends and saves.

Layout, as the runtime builds its mesh (row-major pp, dp, cp, tp): a cp group is cp ranks tp apart;
the dp × cp ranks of one tp index hold the same weights, so gradients are reduced and ZeRO-3 shards
weights, gradients and optimizer states over all dp × cp of them ("dp_cp", `sync_layout`). The
batch splits over dp only: the cp ranks of a dp rank read the same sequences, each a 1/cp share of
every sequence's positions.

Per rank, micro-batch of b sequences of S positions, and attention call (one layer's scaled-dot-
product attention: h heads, g key/value heads as projected, d head dim, e bytes per K/V element):
    B = b · S/cp · g/tp · d · e     one K or V block          Q = b · S/cp · h/tp · d · e
- compute: every op runs on S/cp of each sequence's positions, so per-token work (matmuls, norms,
  the loss) divides by cp, and so does causal attention's triangle: with the sequence cut into 2·cp
  chunks and rank r holding chunks r and 2·cp−1−r, every rank computes the same share of it (the
  load balance of Llama 3's context parallelism, Dubey et al., "The Llama 3 Herd of Models", 2024,
  §3.3.2). The units are priced as for b/cp sequences (`rank_batch`).
- ring: cp rounds of attention, one K/V block each; between rounds every rank sends its current K
  and V to the next cp rank and receives the previous rank's: 2(cp−1) sends and receives of B in the
  forward. Round i+1's transfer overlaps round i's attention (Liu, Zaharia & Abbeel, "Ring
  Attention with Blockwise Transformers", 2023, §3), so with a_f, a_b the rank's attention forward
  and backward time of the call,
      forward exposed  = (cp−1) · max(0, t(2B) − a_f/cp)
      backward exposed = (cp−1) · max(0, t(4B) − a_b/cp) + t(2B)
  since the backward rotates K and V again (cp−1 times) and the dK, dV accumulators cp times, the
  last bringing them home with nothing left to hide behind. t is one point-to-point transfer on the
  cp group's link (`communication.collective_time_s("send_recv")`: NVLink inside a node, a GPU's
  share of the network once the group spans nodes, where the ring runs at its slowest hop); a send
  and a receive use opposite directions of a full-duplex link and do not slow each other.
- ulysses: 4 all-to-alls per attention forward (Q, K, V from sequence to head shards, the output
  back: Jacobs et al., "DeepSpeed Ulysses", 2023, §3.1) and 4 in the backward, each of the tensor
  this rank passes in (Q, the output: Q; K, V: B), on the cp group's layout and not overlapped.
- recompute: a fully recomputed layer repeats its forward's exchange in its backward; selective
  recompute saves attention's output (`runtime.recompute`) and repeats none.
- memory: the b/cp sequences' activations; as buffers, the ring's blocks in flight beside those in
  use (K, V, dK, dV received while the current four are used: 8·B at the backward's peak) or the
  ulysses head-sharded Q, K, V and output (2·Q + 2·B).
Not priced: a ring round's attention is taken as the call's average (the zigzag balances a rank's
total, not every round), and the cp − 1 extra kernel launches per call and the efficiency of shorter
blocks are left out (small next to a long chunk's attention, which is where the search offers cp).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from autopar.cluster import ClusterSpec
from autopar.cost_models.communication import GroupLayout, collective_time_s, group_layout
from autopar.errors import AutoparError
from autopar.plan_schema import Strategy

_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # K/V in the compute precision
RING_BUFFER_BLOCKS = 8  # K, V, dK, dV in use and the four being received
ULYSSES_ALL_TO_ALLS = 4  # Q, K, V in and the output back, per pass


@dataclass(frozen=True)
class AttentionLayer:
    """One attention call, in the cost model's terms (`autopar.graph.attention.AttentionCall`)."""

    unit: str  # the pipeline unit (layer instance) whose forward makes it
    heads: int
    kv_heads: int
    head_dim: int
    seq_len: int
    causal: bool
    autopar_attention: bool  # the zoo's attention, which the runtime's cp shards
    element_bytes: int


def attention_layers(graph, unit_of: dict[str, str]) -> tuple[AttentionLayer, ...]:
    """The graph's attention calls with the unit whose forward runs each (the first op of its module)."""
    element = _ELEMENT_BYTES.get(graph.precision, 4)
    first_unit: dict[str, str] = {}
    for node in graph.nodes:
        if node.phase == "forward" and node.module_path not in first_unit:
            first_unit[node.module_path] = unit_of[node.name]
    layers = []
    for call in graph.attention_calls:
        unit = first_unit.get(call.module_path)
        if unit is not None:
            layers.append(AttentionLayer(unit=unit, heads=call.heads, kv_heads=call.kv_heads, head_dim=call.head_dim,
                                         seq_len=call.seq_len, causal=call.causal,
                                         autopar_attention=call.autopar_attention, element_bytes=element))
    return tuple(layers)


def replicas(strategy: Strategy) -> int:
    """Ranks holding the same weights (and sharing ZeRO shards): dp × cp."""
    return strategy.dp * strategy.cp


def replica_axis(strategy: Strategy) -> str:
    """The ledger's name for the gradient-sync group: "dp", or "dp_cp" when cp > 1."""
    return "dp_cp" if strategy.cp > 1 else "dp"


def sync_layout(strategy: Strategy, gpus_per_node: int) -> GroupLayout:
    """dp × cp ranks tp apart (cp inside dp in the row-major mesh: together one contiguous stride-tp group)."""
    return group_layout(replicas(strategy), strategy.tp, gpus_per_node)


def context_layout(strategy: Strategy, gpus_per_node: int) -> GroupLayout:
    return group_layout(strategy.cp, strategy.tp, gpus_per_node)


def rank_batch(strategy: Strategy) -> float:
    """One rank's share of a micro-batch, in sequences' worth of positions: b/cp."""
    return strategy.microbatch / strategy.cp


def kv_block_bytes(layer: AttentionLayer, strategy: Strategy) -> float:
    """B: one rank's K (or V) block of a micro-batch."""
    s = strategy
    return s.microbatch * layer.seq_len / s.cp * layer.kv_heads / s.tp * layer.head_dim * layer.element_bytes


def query_block_bytes(layer: AttentionLayer, strategy: Strategy) -> float:
    """Q: one rank's queries (or attention output) of a micro-batch."""
    s = strategy
    return s.microbatch * layer.seq_len / s.cp * layer.heads / s.tp * layer.head_dim * layer.element_bytes


def call_exchanges(layer: AttentionLayer, strategy: Strategy, policy: str) -> list[tuple[str, str, float, int]]:
    """(phase, kind, bytes, calls) one attention call sends per micro-batch on one rank: the ledger's
    "cp" rows (forward, backward, and "recompute" under full recompute)."""
    s = strategy
    if s.cp == 1:
        return []
    if s.cp_kind == "ring":
        block = kv_block_bytes(layer, s)
        forward = [("forward", kind, block, 2 * (s.cp - 1)) for kind in ("send", "recv")]
        backward = [("backward", kind, block, 2 * (s.cp - 1) + 2 * s.cp) for kind in ("send", "recv")]
    else:
        query, block = query_block_bytes(layer, s), kv_block_bytes(layer, s)
        forward = [("forward", "all_to_all", query, 2), ("forward", "all_to_all", block, 2)]
        backward = [("backward", kind, size, calls) for _, kind, size, calls in forward]
    repeated = [("recompute", kind, size, calls) for _, kind, size, calls in forward] if policy == "full" else []
    return forward + backward + repeated


def unit_exchanges(layers: Sequence[AttentionLayer], unit: str, strategy: Strategy, policy: str
                   ) -> list[tuple[str, str, float, int]]:
    return [row for layer in layers if layer.unit == unit for row in call_exchanges(layer, strategy, policy)]


def ring_exposed_s(cp: int, transfer_s: Callable[[float], float], block_bytes: float,
                   attention_forward_s: float, attention_backward_s: float) -> tuple[float, float]:
    """(forward, backward) ring exchange not hidden behind the per-block attention (module docstring)."""
    forward = (cp - 1) * max(0.0, transfer_s(2 * block_bytes) - attention_forward_s / cp)
    homecoming = transfer_s(2 * block_bytes)  # the last dK, dV transfer: nothing left to hide behind
    backward = (cp - 1) * max(0.0, transfer_s(4 * block_bytes) - attention_backward_s / cp) + homecoming
    return forward, backward


def unit_exchange_s(layers: Sequence[AttentionLayer], unit: str, strategy: Strategy, policy: str,
                    cluster: ClusterSpec, attention_forward_s: float, attention_backward_s: float
                    ) -> tuple[float, float]:
    """(forward, backward with recompute's) exposed exchange of `unit` per micro-batch. The unit's
    attention time (forward, backward, on this rank) is shared equally by its attention calls."""
    s = strategy
    calls = [layer for layer in layers if layer.unit == unit]
    if s.cp == 1 or not calls:
        return 0.0, 0.0
    layout = context_layout(s, cluster.gpus_per_node)
    forward = backward = 0.0
    for layer in calls:
        if s.cp_kind == "ring":
            f, b = ring_exposed_s(s.cp, lambda size: collective_time_s("send_recv", size, layout, cluster),
                                  kv_block_bytes(layer, s), attention_forward_s / len(calls),
                                  attention_backward_s / len(calls))
        else:
            f = sum(calls_ * collective_time_s("all_to_all", size, layout, cluster)
                    for _, _, size, calls_ in call_exchanges(layer, s, "none")[:2])
            b = f
        forward += f
        backward += b + (f if policy == "full" else 0.0)
    return forward, backward


def exchange_buffer_bytes(layers: Sequence[AttentionLayer], units: Sequence[str], strategy: Strategy) -> float:
    """The exchange's buffers at their peak on a rank holding `units` (one attention call at a time)."""
    s = strategy
    if s.cp == 1:
        return 0.0
    held = set(units)
    mine = [layer for layer in layers if layer.unit in held]
    if not mine:
        return 0.0
    if s.cp_kind == "ring":
        return max(RING_BUFFER_BLOCKS * kv_block_bytes(layer, s) for layer in mine)
    return max(2 * query_block_bytes(layer, s) + 2 * kv_block_bytes(layer, s) for layer in mine)


def context_parallel_refusal(layers: Sequence[AttentionLayer], has_experts: bool) -> str | None:
    """Why the runtime cannot split this model's sequences over cp ranks (None: it can)."""
    if not layers:
        return "context parallelism (cp > 1) splits attention over the sequence; this model has no attention call"
    if not all(layer.autopar_attention and layer.causal for layer in layers):
        return ("the runtime's context parallelism runs the zoo's causal attention (autopar.models gpt and llama); "
                "this model's attention is its own: leave cp out")
    if has_experts:
        return ("the runtime's context parallelism runs dense models; this one has mixture-of-experts layers: "
                "leave cp out")
    return None


def check_context(strategy: Strategy, seq_len: int | None, heads: int | None, kv_heads: int | None) -> None:
    """Raise AutoparError naming the cp rule the strategy breaks: the ring's 2·cp chunks, or ulysses's
    heads per tp rank dividing over cp."""
    s = strategy
    if s.cp == 1:
        return
    if s.cp_kind == "ring" and seq_len and seq_len % (2 * s.cp):
        raise AutoparError(f"cp={s.cp} ring cuts the sequence into 2×cp = {2 * s.cp} equal chunks, and {seq_len} "
                           f"positions do not divide: choose cp with 2×cp dividing {seq_len}")
    if s.cp_kind == "ulysses" and seq_len and seq_len % s.cp:
        raise AutoparError(f"cp={s.cp} ulysses cuts the sequence into {s.cp} equal chunks, and {seq_len} positions "
                           f"do not divide: choose cp dividing {seq_len}")
    if s.cp_kind == "ulysses":
        for name, count in (("attention heads", heads), ("key/value heads", kv_heads)):
            if count and (count % s.tp or (count // s.tp) % s.cp):
                raise AutoparError(f"cp={s.cp} ulysses splits the {count} {name} over tp×cp = {s.tp}×{s.cp}: "
                                   f"choose tp×cp dividing {count}, or cp_kind=ring")
