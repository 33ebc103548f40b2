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
(selective): the hooks are not installed there, since the checkpoint's own hooks must see its saves;
nor outside the layers (the cost model's layer units), where the model counts gathered inputs.
Saved-tensor hooks bypass autograd's check that a saved tensor was not changed in place, so the
hooks make their own: a gathered input changed in place is kept as it is, and a shard changed in
place before backward is an error, as autograd's.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed._functional_collectives as functional
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


# torch 2.13 renamed it (the old name warns); the device machines' 2.11 may have only the old one
_all_gather = getattr(functional, "all_gather_single", None) or functional.all_gather_tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class _Regather:
    """One block call's shard and its gathered copy, rebuilt once per backward for all who saved it."""

    def __init__(self, shard: torch.Tensor, mesh: DeviceMesh, dim: int) -> None:
        # saved-tensor hooks bypass autograd's in-place check: ours, on the tensor the block was handed
        # (a DTensor's in-place ops count on it, not on its local tensor)
        self.source, self.version = shard, shard._version
        self.shard, self.mesh, self.dim = _local(shard).contiguous(), mesh, dim
        self.saved = 0  # tensors saved on the gathered storage
        self.pending = 0  # of those, not yet unpacked in this backward
        self.gathered: torch.Tensor | None = None

    def unpacked(self) -> torch.Tensor:
        if self.gathered is None:
            if self.source._version != self.version:
                raise RuntimeError("one of the variables needed for gradient computation has been modified by an "
                                   "inplace operation: a tensor-parallel block's input shard, kept for backward "
                                   "(sp_inputs=regathered); plan with sp_inputs=gathered")
            gathered = _all_gather(self.shard, gather_dim=self.dim, group=(self.mesh, 0))
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
        if not usable:
            warnings.warn("a sequence-parallel block's gathered input is not one contiguous tensor: it is kept "
                          "whole, more memory than the plan priced (sp_inputs=regathered)", stacklevel=2)
        regather = _Regather(shard, mesh, dim)
        key, versions = storage._cdata, {True: gathered._version, False: whole._version}

        def pack(tensor: torch.Tensor):
            local = _local(tensor)
            if not usable or local.untyped_storage()._cdata != key:
                return tensor
            if tensor._version != versions[isinstance(tensor, DTensor)]:
                return tensor  # changed in place since the gather: the shard would not rebuild it, kept as it is
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


def shard_layers(plan) -> tuple[str, ...] | None:
    """For `apply_tensor_parallel`: the layers whose blocks keep their shards (`Strategy.sp_inputs ==
    "regathered"`), the plan's layer units it does not recompute, as the cost model counts them
    (`cost_models.collectives.keeps_shards`); None when the plan keeps the gathered inputs."""
    s = plan.strategy
    if not s.sp or s.sp_inputs != "regathered":
        return None
    recomputed = set(plan.recompute_modules) if s.recompute != "none" else set()
    return tuple(unit for stage in plan.stages for unit in stage.units
                 if unit not in ("pre", "post") and not unit.startswith("between.") and unit not in recomputed)
