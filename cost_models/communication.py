"""Collective communication time under the alpha-beta model, per link level.

A collective over `n` ranks moving `message_bytes` (the full logical buffer) costs
    ring all-reduce            2(n-1)/n · S/β + 2(n-1)·α
    all-gather, reduce-scatter (n-1)/n · S/β + (n-1)·α       (S: the gathered / reduced size)
    all-to-all                 (n-1)/n · S/β + (n-1)·α
    broadcast (pipelined ring) S/β + (n-1)·α
    send/recv                  S/β + α
(Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH",
IJHPCA 2005; Patarasuk & Yuan 2009 for the bandwidth-optimal ring.) β is the per-GPU,
one-direction bandwidth of the slowest link the ring crosses.

Groups that span nodes use the hierarchical algorithm NCCL and Megatron rely on: reduce-scatter
inside each node over NVLink, an all-reduce across nodes on 1/k of the data (each of the k GPUs of
a node driving its own NIC), then an all-gather inside the node.

Latency grows with the ranks and nodes a collective crosses, as NCCL's own tuning model has it
(NVIDIA/nccl src/graph/tuning.cc, `ncclTopoTuneModel`; the Simple protocol that large messages
use): a ring pays a base latency plus one link latency per step, 2(n−1) steps for an all-reduce
(n−1 for all-gather and reduce-scatter), the steps that cross nodes at the network's latency; a
tree all-reduce pays 2·((k−1) + log2(nodes)) steps of its own latency and reaches 0.92 of the
ring's bus bandwidth. NCCL runs whichever is faster for the message, so the all-reduce here does
too. The per-step link latencies are the links' `latency_s` (`autopar.cluster`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.cluster import ClusterSpec, LinkSpec

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")

# NCCL's tuning model (src/graph/tuning.cc, NCCL 2.18-2.21, Simple protocol): a ring's base latency
# per call; a tree's latency per step (28 µs over NVLink and over the network alike); the fraction
# of the bus bandwidth a tree reaches (`busBw*.92`); and the "plateau effect of ring" that
# multiplies a multi-node ring all-reduce's latency by 1.9 for large messages.
RING_BASE_LATENCY_S = 8.4e-6
TREE_STEP_LATENCY_S = 28e-6
TREE_BANDWIDTH_FRACTION = 0.92
RING_PLATEAU_FACTOR = 1.9


@dataclass(frozen=True)
class GroupLayout:
    """Where a process group's ranks sit: `ranks_per_node` of them in each of `nodes` nodes."""

    size: int
    ranks_per_node: int
    nodes: int


def group_layout(size: int, stride: int, gpus_per_node: int) -> GroupLayout:
    """Layout of a group of `size` ranks spaced `stride` apart in a node-major rank order.

    Mesh axes map to strides: the innermost axis (tp) has stride 1 and stays inside a node when
    it fits; an outer axis (dp, pp) has the product of the inner sizes as its stride.
    """
    if size <= 1:
        return GroupLayout(size=max(size, 1), ranks_per_node=1, nodes=1)
    per_node = max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1
    return GroupLayout(size=size, ranks_per_node=per_node, nodes=-(-size // per_node))


def flat_collective_time_s(kind: str, message_bytes: float, n: int, link: LinkSpec) -> float:
    """One flat ring over `n` ranks on one kind of link."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; known: {', '.join(COLLECTIVES)}")
    alpha, beta = link.latency_s, link.effective_bandwidth_bytes_per_s
    if kind == "send_recv":
        return alpha + message_bytes / beta
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * message_bytes / beta + 2 * (n - 1) * alpha
    if kind == "broadcast":
        return message_bytes / beta + (n - 1) * alpha
    return (n - 1) / n * message_bytes / beta + (n - 1) * alpha


def collective_time_s(kind: str, message_bytes: float, layout: GroupLayout, cluster: ClusterSpec) -> float:
    """Time of a collective on a group laid out over the cluster (hierarchical across nodes), its
    latency growing with ranks and nodes (see the module docstring)."""
    if layout.size <= 1 and kind != "send_recv":
        return 0.0
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; known: {', '.join(COLLECTIVES)}")
    if kind == "send_recv":
        link = cluster.intra_node if layout.nodes <= 1 else cluster.inter_node
        return flat_collective_time_s(kind, message_bytes, 2, link)
    bandwidth = _bandwidth_time_s(kind, message_bytes, layout, cluster)
    ring = bandwidth + ring_latency_s(kind, layout, cluster)
    if kind != "all_reduce":
        return ring
    return min(ring, bandwidth / TREE_BANDWIDTH_FRACTION + tree_latency_s(layout))


def ring_latency_s(kind: str, layout: GroupLayout, cluster: ClusterSpec) -> float:
    """A ring's latency: a base per call and a link latency per step, the steps between nodes at
    the network's (NCCL's `nsteps`/`nInterSteps`)."""
    n, nodes = layout.size, layout.nodes
    if kind == "all_reduce":
        steps, inter_steps = 2 * (n - 1), (2 * nodes if nodes > 1 else 0)
    elif kind == "broadcast":
        steps, inter_steps = n - 1, nodes - 1
    else:
        steps, inter_steps = n - 1, nodes - 1
    intra = cluster.intra_node.latency_s
    inter = cluster.inter_node.latency_s if (nodes > 1 and cluster.inter_node is not None) else intra
    latency = RING_BASE_LATENCY_S + max(steps - inter_steps, 0) * intra + min(inter_steps, steps) * inter
    return latency * (RING_PLATEAU_FACTOR if kind == "all_reduce" and nodes > 1 else 1.0)


def tree_latency_s(layout: GroupLayout) -> float:
    """A tree all-reduce's latency: up and down a chain inside the node and a binary tree across nodes."""
    return 2 * ((layout.ranks_per_node - 1) + math.log2(layout.nodes)) * TREE_STEP_LATENCY_S


def _bandwidth_time_s(kind: str, message_bytes: float, layout: GroupLayout, cluster: ClusterSpec) -> float:
    """The bandwidth part: a flat ring inside one node, the hierarchical algorithm across nodes."""
    intra = cluster.intra_node
    if layout.nodes <= 1:
        return _ring_bandwidth_s(kind, message_bytes, layout.size, intra)
    inter = cluster.inter_node
    assert inter is not None, "a multi-node cluster always has an inter-node link"
    k, nodes = layout.ranks_per_node, layout.nodes
    if kind == "all_reduce":
        return (_ring_bandwidth_s("reduce_scatter", message_bytes, k, intra)
                + _ring_bandwidth_s("all_reduce", message_bytes / k, nodes, inter)
                + _ring_bandwidth_s("all_gather", message_bytes, k, intra))
    if kind in ("all_gather", "reduce_scatter"):
        # Each node's k GPUs move their 1/k share of the inter-node part in parallel, then the
        # node-local step completes it over NVLink.
        return (_ring_bandwidth_s(kind, message_bytes / k, nodes, inter)
                + _ring_bandwidth_s(kind, message_bytes, k, intra))
    if kind == "all_to_all":
        # Of each rank's data, (nodes-1)/nodes leaves the node over its own NIC.
        return ((nodes - 1) / nodes * message_bytes / inter.effective_bandwidth_bytes_per_s
                + _ring_bandwidth_s("all_to_all", message_bytes / nodes, k, intra))
    return _ring_bandwidth_s(kind, message_bytes, layout.size, inter)  # broadcast


def _ring_bandwidth_s(kind: str, message_bytes: float, n: int, link: LinkSpec) -> float:
    """`flat_collective_time_s` without its latency."""
    if n <= 1:
        return 0.0
    beta = link.effective_bandwidth_bytes_per_s
    if kind == "all_reduce":
        return 2 * (n - 1) / n * message_bytes / beta
    if kind == "broadcast":
        return message_bytes / beta
    return (n - 1) / n * message_bytes / beta
