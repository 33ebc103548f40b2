"""What a checkpoint of the running plan should cost, for `autopar run` to print beside what it costs.

Gathers every rank's expected share of the checkpoint (runtime/checkpoint/state.py), measures
this machine's sha256 rate, and prices the save and the checkpoint interval with the pure
functions of cost_models/checkpoint.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from autopar.cost_models import checkpoint as cost


@dataclass(frozen=True)
class SavePrediction:
    save_time_s: float
    busiest_node_bytes: int
    node_storage_write_bytes_per_s: float
    hash_bytes_per_s: float
    nominal: bool  # the storage figure is the CPU cluster's placeholder, not a datasheet's
    world_size: int

    def interval_text(self, step_time_s: float | None) -> str:
        """Young/Daly's suggestion at Llama 3's failure rate, as one clause."""
        mtbf_s = cost.mean_time_between_failures_s(self.world_size)
        interval_s = cost.checkpoint_interval_s(self.save_time_s, mtbf_s)
        text = (f"at Llama 3's failure rate (419 unexpected interruptions in 54 days on 16,384 GPUs) {self.world_size} "
                f"GPU(s) fail once per {mtbf_s / 3600:,.0f} h: Young/Daly suggests a checkpoint every "
                f"{interval_s / 3600:,.2f} h")
        if step_time_s:
            every = cost.checkpoint_every_steps(self.save_time_s, step_time_s, mtbf_s)
            text += f" = --checkpoint-every {every:,} at the plan's {step_time_s:.3g} s per step"
        return text

    def describe(self) -> str:
        nominal = ", a nominal figure" if self.nominal else ""
        return (f"predicted {self.save_time_s:.3g} s ({self.busiest_node_bytes / 1e6:,.1f} MB from the busiest node "
                f"at {self.node_storage_write_bytes_per_s / 1e9:.3g} GB/s{nominal}, sha256 at "
                f"{self.hash_bytes_per_s / 1e9:.2f} GB/s)")


def predict_save(parallel, optimizer, cluster_spec: str | None) -> SavePrediction | None:
    """The running plan's checkpoint cost (a collective: every rank calls it). None without a
    cluster to take the storage bandwidth from (a --plan run given no --cluster)."""
    from autopar.cluster import load_cluster
    from autopar.errors import AutoparError
    from autopar.runtime.checkpoint.files import sha256_bytes_per_s
    from autopar.runtime.checkpoint.state import expected_write_bytes

    if not cluster_spec:  # the same on every rank, so no rank waits in the gather below
        return None
    try:
        cluster = load_cluster(cluster_spec)
    except AutoparError:  # the run already loaded it once; a file changed since is no reason to stop
        return None
    mine = expected_write_bytes(parallel, optimizer)
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_rank = [mine]
    if world > 1:
        per_rank = [0] * world
        dist.all_gather_object(per_rank, mine)
    cpu = cluster.gpu.name == "cpu"  # the nominal CPU cluster: all processes on this one machine
    ranks_per_node = world if cpu else min(cluster.gpus_per_node, world)
    hash_rate = sha256_bytes_per_s()
    nodes = [sum(per_rank[start:start + ranks_per_node]) for start in range(0, world, ranks_per_node)]
    return SavePrediction(save_time_s=cost.save_time_s(per_rank, ranks_per_node, cluster.node_storage_write_bytes_per_s,
                                                       hash_rate),
                          busiest_node_bytes=max(nodes), node_storage_write_bytes_per_s=cluster.node_storage_write_bytes_per_s,
                          hash_bytes_per_s=hash_rate, nominal=cpu, world_size=world)
