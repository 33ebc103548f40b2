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
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import ClusterSpec, LinkSpec

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


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
    """Time of a collective on a group laid out over the cluster (hierarchical across nodes)."""
    if layout.size <= 1 and kind != "send_recv":
        return 0.0
    intra = cluster.intra_node
    if layout.nodes <= 1:
        return flat_collective_time_s(kind, message_bytes, layout.size, intra)
    inter = cluster.inter_node
    assert inter is not None, "a multi-node cluster always has an inter-node link"
    k, nodes = layout.ranks_per_node, layout.nodes
    if kind == "send_recv":
        return flat_collective_time_s(kind, message_bytes, 2, inter)
    if kind == "all_reduce":
        return (
            flat_collective_time_s("reduce_scatter", message_bytes, k, intra)
            + flat_collective_time_s("all_reduce", message_bytes / k, nodes, inter)
            + flat_collective_time_s("all_gather", message_bytes, k, intra)
        )
    if kind in ("all_gather", "reduce_scatter"):
        # Each node's k GPUs move their 1/k share of the inter-node part in parallel, then the
        # node-local step completes it over NVLink.
        return (
            flat_collective_time_s(kind, message_bytes / k, nodes, inter)
            + flat_collective_time_s(kind, message_bytes, k, intra)
        )
    if kind == "all_to_all":
        # Of each rank's data, (nodes-1)/nodes leaves the node over its own NIC.
        inter_fraction = (nodes - 1) / nodes
        return (
            inter_fraction * message_bytes / inter.effective_bandwidth_bytes_per_s
            + (layout.size - 1) * inter.latency_s
            + flat_collective_time_s("all_to_all", message_bytes / nodes, k, intra)
        )
    return flat_collective_time_s(kind, message_bytes, layout.size, inter)  # broadcast
