"""Keep a tensor-parallel block's sequence shard for backward, not the input it gathers (`sp_inputs=regathered`).

Under sequence parallelism a block's input arrives as a sequence shard and is all-gathered once for
all of its column-parallel projections (`module_rules._BlockInput`). Each projection saves what it
read for its weight gradient, so autograd would keep the gathered tensor, tp times the shard, from
forward to backward. While the block's forward runs, saved-tensor hooks swap every tensor saved on
the gathered storage for the shard, and the first projection differentiated all-gathers it again:
one more all-gather per block and micro-batch in backward, which the cost model and the ledger
carry (`cost_models.collectives.regathered_inputs`). Megatron-LM keeps the shard the same way
(Korthikanti et al. 2022, §4.2.2); it overlaps the gather with the input gradient, which this
runtime does not.

A checkpointed block keeps nothing of its own (full recompute) or keeps the gather its policy saves
(selective): the hooks are not installed there, since the checkpoint's own hooks must see its saves.
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor, all_gather_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class _Regather:
    """One block call's shard and its gathered copy, rebuilt once per backward for all who saved it."""

    def __init__(self, shard: torch.Tensor, mesh: DeviceMesh, dim: int) -> None:
        self.shard, self.mesh, self.dim = shard.contiguous(), mesh, dim
        self.saved = 0  # tensors saved on the gathered storage
        self.pending = 0  # of those, not yet unpacked in this backward
        self.gathered: torch.Tensor | None = None

    def unpacked(self) -> torch.Tensor:
        if self.gathered is None:
            gathered = all_gather_tensor(self.shard, gather_dim=self.dim, group=(self.mesh, 0))
            self.gathered = gathered.wait() if isinstance(gathered, AsyncCollectiveTensor) else gathered
            self.pending = self.saved
        full = self.gathered
        self.pending -= 1
        if self.pending <= 0:  # the last reader: free it (a second backward gathers again)
            self.gathered = None
        return full


class KeepShard(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks for one block call: tensors on `gathered`'s storage are kept as `shard`."""

    def __init__(self, shard: torch.Tensor, gathered: torch.Tensor, mesh: DeviceMesh, dim: int) -> None:
        storage = _local(gathered).untyped_storage()
        whole = _local(gathered)
        # The gather's output is a fresh contiguous tensor: its storage is exactly it, so a view of it
        # is rebuilt from the gathered copy by its size, stride and offset alone.
        usable = whole.is_contiguous() and whole.storage_offset() == 0 and storage.nbytes() == whole.nbytes
        regather = _Regather(_local(shard), mesh, dim)
        key = storage._cdata

        def pack(tensor: torch.Tensor):
            local = _local(tensor)
            if not usable or local.untyped_storage()._cdata != key:
                return tensor
            regather.saved += 1
            spec = (tensor.placements, tensor.shape, tensor.stride()) if isinstance(tensor, DTensor) else None
            return regather, (local.size(), local.stride(), local.storage_offset()), spec

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            source, geometry, spec = packed
            view = source.unpacked().as_strided(*geometry)
            if spec is None:
                return view
            placements, shape, stride = spec
            return DTensor.from_local(view, mesh, placements, run_check=False, shape=shape, stride=stride)

        super().__init__(pack, unpack)


def regathered_outside(plan) -> tuple[str, ...] | None:
    """For `apply_tensor_parallel`: the modules the plan recomputes when it keeps the shards outside them
    (`Strategy.sp_inputs == "regathered"`), None when it keeps the gathered inputs."""
    s = plan.strategy
    if not s.sp or s.sp_inputs != "regathered":
        return None
    return tuple(plan.recompute_modules) if s.recompute != "none" else ()
