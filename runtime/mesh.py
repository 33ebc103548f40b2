"""The device mesh of a plan, and which pipeline stages this rank runs.

The mesh is (pp, dp, cp, tp), row-major: a pipeline rank owns a contiguous block of dp·cp·tp ranks
and a dp rank's cp x tp ranks are contiguous. A plan without a "cp" axis runs with cp = 1. Under
context parallelism the cp ranks hold the same weights, so gradients are reduced (and ZeRO shards
spread) over the dp x cp ranks: the flattened "dp_cp" sub-mesh (`gradient_mesh`).

Checked before any collective is issued, so a plan for another world size fails with one line
instead of a hang.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.errors import AutoparError
from autopar.plan_schema import Plan, stage_rank

AXES = ("pp", "dp", "cp", "tp")
OPTIONAL_AXES = ("cp",)  # absent from a plan: size 1


@dataclass
class RankLayout:
    """Where this rank sits: its mesh, its pipeline stages and its coordinates."""

    mesh: DeviceMesh
    stage_indices: list[int]  # virtual stages this rank runs, in order
    pp_rank: int
    dp_rank: int
    tp_rank: int
    device: torch.device
    cp_rank: int = 0

    def size(self, axis: str) -> int:
        return self.mesh.size(AXES.index(axis))

    def group(self, axis: str) -> dist.ProcessGroup:
        return self.mesh.get_group(axis)

    def gradient_mesh(self) -> DeviceMesh:
        """The ranks holding the same weights: dp, or dp x cp flattened under context parallelism."""
        return self.mesh["dp"] if self.size("cp") == 1 else self.mesh["dp_cp"]

    def gradient_group(self) -> dist.ProcessGroup:
        return self.gradient_mesh().get_group()


def runtime_device() -> torch.device:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def check_world(plan: Plan) -> None:
    """The process group must exist and match the plan's world size (one line, before any collective)."""
    want = plan.provenance.world_size
    if not dist.is_available() or not dist.is_initialized():
        if want > 1:
            raise AutoparError(
                f"the plan needs {want} processes but no process group is running: launch with "
                f"`torchrun --nproc-per-node {want} -m autopar run ...`"
            )
        return
    world = dist.get_world_size()
    if world != want:
        raise AutoparError(
            f"the plan is for {want} processes but {world} are running: launch {want} "
            f"(torchrun --nproc-per-node {want}) or re-plan for {world} with `autopar plan --gpus {world}`"
        )
    names = [axis.name for axis in plan.mesh]
    if sorted(names) != sorted(AXES) and sorted(names) != sorted(set(AXES) - set(OPTIONAL_AXES)):
        raise AutoparError(f"the runtime executes meshes with axes {', '.join(AXES)}, the plan has {', '.join(names)}: "
                           f"re-run `autopar plan`")


def build_layout(plan: Plan) -> RankLayout:
    check_world(plan)
    device = runtime_device()
    sizes = {"cp": 1} | {axis.name: axis.size for axis in plan.mesh}
    if not dist.is_initialized():  # one process: a local group of one keeps every code path the same
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl", rank=0, world_size=1,
                                store=dist.HashStore())
    mesh = init_device_mesh(device.type, tuple(sizes[a] for a in AXES), mesh_dim_names=AXES)
    if sizes["cp"] > 1:  # every rank creates the flattened group, in one order
        # its own communicator (the override), never the world's or cp's reused: the collective
        # counter tells gradient sync ("dp_cp") from cp's exchange and the step's scalars by it
        mesh["dp", "cp"]._flatten("dp_cp", backend_override=(dist.get_backend(), None))
    rank = dist.get_rank()
    stage_size = sizes["dp"] * sizes["cp"] * sizes["tp"]
    stages = [s.index for s in plan.stages if rank in s.device_ids]
    for s in plan.stages:  # the mesh is (pp, dp, cp, tp) row-major: stage rank r owns a contiguous block
        pp_rank = stage_rank(s.index, sizes["pp"], plan.strategy.schedule)
        block = set(range(pp_rank * stage_size, (pp_rank + 1) * stage_size))
        if set(s.device_ids) != block:
            raise AutoparError(
                f"plan stage {s.index} runs on devices {s.device_ids}, but the runtime places pipeline rank "
                f"{pp_rank} on devices {sorted(block)}: re-run `autopar plan`"
            )
    coordinate = mesh.get_coordinate()
    return RankLayout(mesh=mesh, stage_indices=stages, pp_rank=coordinate[0], dp_rank=coordinate[1],
                      cp_rank=coordinate[2], tp_rank=coordinate[3], device=device)
