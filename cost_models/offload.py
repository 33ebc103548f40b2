"""Optimizer-state offload (`offload=optimizer`): what moves to host memory and what it costs.

Priced as autopar's runtime runs it, FSDP2's CPUOffloadPolicy (not ZeRO-Offload's schedule, Ren
et al. 2021, which also overlaps the CPU step with the next forward and delays parameter updates):
- Host memory holds each rank's shard of the fp32 weights (the master copy), the reduced fp32
  gradients and Adam's two moments: 16 bytes per parameter shard (12 with bf16 moments). The
  device keeps the compute-precision weights and gradients; it loses the optimizer states.
- PCIe moves parameter shards host→device (4 bytes each, before their unit's all-gather, prefetched
  one FSDP unit ahead) and gradient shards device→host (4 bytes, after their reduce-scatter),
  as often as the ZeRO stage gathers and reduces (`transfers_per_step`). Each direction hides
  behind the passes it overlaps except, at least, one unit's share.
- The host step runs on the CPU after the last backward, exposed: the gradient clipping (its norm
  and scaling, on the host shards) and torch's fused CPU AdamW (`runtime.optimizer`). Priced at the
  host's measured rate of both (`ClusterSpec.host_optimizer_params_per_s`, which `--cluster local`
  measures, `autopar.host_rates`), shared by the node's GPUs; without one, as their 28 + 12 bytes per
  parameter over the GPU's share of the node's host memory bandwidth at `CPU_ADAM_EFFICIENCY`. The
  device's own optimizer step is gone.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import ClusterSpec
from autopar.cost_models.optimizer import CLIP_BYTES_PER_PARAM

# fp32 weight and gradient, each copied once per step in each direction
TRANSFER_BYTES_PER_PARAM = 4
# CPU Adam moves what the device's does: read weight, gradient and two moments, write weight and
# moments (no low-precision copy: the cast happens on the device before the all-gather).
CPU_ADAM_BYTES_PER_PARAM = 28
# Gradient clipping runs on the host shards too (the runtime clips before every step): a norm read, the
# scale applied inside the fused CPU AdamW (`cost_models.optimizer`). Before it was (af063d4) a scaling
# pass read and wrote every gradient as well: on the lent H200's 16-core host the clipping took 1.16 s
# beside AdamW's 0.72 s for GPT-2.7B (benchmarks/gpu_diagnose.py).
HOST_STEP_BYTES_PER_PARAM = CPU_ADAM_BYTES_PER_PARAM + CLIP_BYTES_PER_PARAM["fused"]
# torch's fused CPU AdamW (fp32) moves its 28 bytes per parameter at 1.7 (one thread) to 2.1 (two
# threads) times the rate a plain tensor copy reaches on the same sizes, 2**25 parameters
# (benchmarks/cpu_adam_rate.py --implementation fused on this 2-core VM; the foreach step, which the
# runtime no longer runs on the host, reached 0.27-0.33). Its updates are in place, so it pays none of
# the copy's write-allocate traffic: it runs at the memory's own rate. Taken as the datasheet's DDR
# bandwidth, an upper bound (a host sustains a share of its datasheet); a measured rate replaces it.
CPU_ADAM_EFFICIENCY = 1.0


def host_bytes_per_param(optimizer_state: str = "fp32") -> int:
    """Host bytes per parameter of a rank's shard: fp32 weight + fp32 gradient + Adam moments."""
    return 4 + 4 + (4 if optimizer_state == "bf16" else 8)


@dataclass(frozen=True)
class OffloadCost:
    """One pipeline rank's offload: the PCIe transfers (each direction, and what stays exposed),
    the CPU Adam step, and the host memory the rank's shard takes."""

    host_to_device_s: float
    device_to_host_s: float
    exposed_transfer_s: float
    cpu_step_s: float
    host_bytes: float


def pcie_time_s(bytes_moved: float, cluster: ClusterSpec) -> float:
    link = cluster.host_link
    return bytes_moved / link.effective_bandwidth_bytes_per_s + link.latency_s if bytes_moved else 0.0


def cpu_adam_time_s(params: float, cluster: ClusterSpec) -> float:
    """The host step (clipping, then AdamW) of a GPU's shard. The node's GPUs step their shards at
    once, so each gets its share of the host: of its measured rate when the cluster has one, else of
    its memory bandwidth."""
    if cluster.host_optimizer_params_per_s is not None:
        return params * cluster.gpus_per_node / cluster.host_optimizer_params_per_s
    per_gpu = cluster.host_memory_bandwidth_bytes_per_s / cluster.gpus_per_node
    return params * HOST_STEP_BYTES_PER_PARAM / (per_gpu * CPU_ADAM_EFFICIENCY)


def transfers_per_step(zero: int, num_microbatches: int) -> tuple[int, int]:
    """(host→device, device→host) copies of the shard per step, as the runtime's FSDP2 units make
    them (`runtime.data_parallel.set_microbatch_boundary`): ZeRO 1/2 gather the weights once per
    step, ZeRO 3 before every forward and backward; ZeRO 1 reduces gradients once per step, ZeRO 2/3
    every micro-batch (each reduced shard is copied to the host and summed there)."""
    h2d = 2 * num_microbatches if zero >= 3 else 1
    d2h = num_microbatches if zero >= 2 else 1
    return h2d, d2h


def offload_cost(shard_params: float, cluster: ClusterSpec, *, zero: int, num_microbatches: int,
                 forward_s: float, backward_s: float, units: int, optimizer_state: str = "fp32") -> OffloadCost:
    """`shard_params`: parameters of the rank's optimizer shard (its share over dp). `forward_s`,
    `backward_s`: one micro-batch's passes on the rank, which the copies overlap (ZeRO 1/2's weight
    copies the first forward, ZeRO 3's every pass; ZeRO 1's gradient copies the last backward, ZeRO
    2/3's every backward). `units`: FSDP units on the rank; at least one unit's copy is exposed."""
    h2d_count, d2h_count = transfers_per_step(zero, num_microbatches)
    h2d = h2d_count * pcie_time_s(shard_params * TRANSFER_BYTES_PER_PARAM, cluster)
    d2h = d2h_count * pcie_time_s(shard_params * TRANSFER_BYTES_PER_PARAM, cluster)
    h2d_window = num_microbatches * (forward_s + backward_s) if zero >= 3 else forward_s
    d2h_window = num_microbatches * backward_s if zero >= 2 else backward_s
    units = max(units, 1)
    exposed = max(h2d - h2d_window, h2d / h2d_count / units) + max(d2h - d2h_window, d2h / d2h_count / units)
    return OffloadCost(host_to_device_s=h2d, device_to_host_s=d2h, exposed_transfer_s=exposed,
                       cpu_step_s=cpu_adam_time_s(shard_params, cluster),
                       host_bytes=shard_params * host_bytes_per_param(optimizer_state))


def node_host_bytes(rank_host_bytes: list[float], cluster: ClusterSpec) -> float:
    """The fullest node's host memory: a node's GPUs are consecutive ranks of the (pp, dp, tp)
    mesh, so with pp > 1 a node may hold several pipeline ranks; priced at the largest rank's
    share times the GPUs on a node (an upper bound)."""
    return max(rank_host_bytes, default=0.0) * cluster.gpus_per_node


def host_capacity_bytes(cluster: ClusterSpec) -> float:
    """What a plan may place in a node's host memory: all of it less the planner's headroom share
    (the operating system, the data loader and pinned staging buffers live there too)."""
    return cluster.host_memory_bytes * (1 - cluster.memory_headroom)
