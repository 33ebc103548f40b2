"""Checkpoint cost: how long a plan's checkpoint takes to save, and how often to save one.

Saving (runtime/checkpoint/checkpointer.py) has every rank write its share of the state (DCP writes a tensor
replicated on several ranks once, spread over them), then hash what it wrote for the manifest.
Ranks on one node share that node's link to storage, so the save takes as long as the busiest node
needs to write its ranks' bytes, plus the longest hashing of one rank's bytes.

How often: Young's first-order optimum interval between checkpoints, sqrt(2 C M) for a checkpoint
cost C and a mean time between failures M (J. W. Young, "A first order approximation to the
optimum checkpoint interval", CACM 17(9), 1974), with Daly's higher-order correction (J. T. Daly,
"A higher order estimate of the optimum checkpoint interval for restart dumps", Future Generation
Computer Systems 22(3), 2006). CheckFreq (FAST '21) and Gemini (SOSP '23) likewise choose
the frequency from the checkpoint's cost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Llama 3's pre-training (Dubey et al., "The Llama 3 Herd of Models", 2024, section 3.3.4): 419
# unexpected interruptions in a 54-day snapshot on 16,384 H100 GPUs; per GPU and hour.
LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16_384)


def save_time_s(bytes_per_rank: Sequence[int], ranks_per_node: int, node_storage_write_bytes_per_s: float,
                hash_bytes_per_s: float) -> float:
    """Seconds to save one checkpoint: ranks 0..k-1 on node 0, k..2k-1 on node 1, ..."""
    if ranks_per_node < 1 or node_storage_write_bytes_per_s <= 0 or hash_bytes_per_s <= 0:
        raise ValueError("ranks_per_node and both bandwidths must be positive")
    nodes = [sum(bytes_per_rank[start:start + ranks_per_node])
             for start in range(0, len(bytes_per_rank), ranks_per_node)]
    busiest_node_bytes = max(nodes, default=0)
    largest_rank_bytes = max(bytes_per_rank, default=0)
    return busiest_node_bytes / node_storage_write_bytes_per_s + largest_rank_bytes / hash_bytes_per_s


def mean_time_between_failures_s(num_gpus: int,
                                 failures_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR) -> float:
    """A job's MTBF when each of its GPUs fails independently at `failures_per_gpu_hour`."""
    if num_gpus < 1 or failures_per_gpu_hour <= 0:
        raise ValueError("num_gpus and the failure rate must be positive")
    return 3600.0 / (num_gpus * failures_per_gpu_hour)


def checkpoint_interval_s(save_time_s: float, mtbf_s: float) -> float:
    """Compute time between checkpoints that loses the least time to saving and to rework after a
    failure (Daly 2006; Young's sqrt(2 C M) is its first term). A save as long as 2 M or
    more: checkpoint once per M."""
    if save_time_s < 0 or mtbf_s <= 0:
        raise ValueError("the save time must be 0 or more and the MTBF positive")
    if save_time_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = save_time_s / (2 * mtbf_s)
    return math.sqrt(2 * save_time_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save_time_s


def checkpoint_every_steps(save_time_s: float, step_time_s: float, mtbf_s: float) -> int:
    """`checkpoint_interval_s` in whole training steps (at least 1)."""
    if step_time_s <= 0:
        raise ValueError("the step time must be positive")
    return max(1, round(checkpoint_interval_s(save_time_s, mtbf_s) / step_time_s))
