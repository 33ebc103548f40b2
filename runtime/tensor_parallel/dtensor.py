"""Tensor parallelism carried by DTensor through the model's own forward ("dtensor" realization).

The module-rule realization (`runtime.tensor_parallel.module_rules`) hands column-parallel Linears' local
shards to the model's code, so a forward that reshapes with its configured head count, splits a
fused projection or runs a convolution first breaks. Here every parameter becomes a DTensor over
the tp mesh with its planned placement (R, S(0), S(1), ...), and the model's forward runs on
DTensors: views see global shapes, and DTensor's sharding propagation inserts the collectives
each op needs. What those are is not derived by hand: `runtime.tensor_parallel.dry_run` runs this same code
on fake tensors and records them, and the plan is priced from that record.

Three things make an arbitrary forward run:
- plain tensors (inputs, buffers, tensors made inside forward such as positions or masks) are
  implicitly replicated (`implicit_replication`, entered by the training step around forward
  and backward, since saved plain tensors meet DTensors again in backward);
- a module that owns a sharded parameter hands on its output reduced (a pending partial sum,
  e.g. of a row-parallel projection or a vocabulary-parallel embedding, is all-reduced at the
  module boundary, once, as Megatron-LM does, rather than by every consumer);
- the model's outputs leave as plain tensors (replicated), except logits sharded over the
  vocabulary when the loss runs under `loss_parallel`.
CPU attention needs the handler in `runtime.tensor_parallel.dtensor_rules`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.placement_types import _MaskPartial
from torch.utils._pytree import tree_map_only

import autopar.runtime.tensor_parallel.dtensor_rules  # noqa: F401  (registers the CPU attention handler)
from autopar.errors import AutoparError
from autopar.plan_schema import parse_placements


def placement_of(text: str):
    """"S(0)" -> Shard(0), "R" -> Replicate()."""
    ((kind, dim),) = parse_placements(text)
    if kind == "R":
        return Replicate()
    if kind == "S":
        return Shard(dim)
    raise AutoparError(f"placement {text!r} over tp is not executable: use R or S(<dim>)")


def apply_dtensor_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, placements: dict[str, str],
                                  vocab_parallel_logits: bool) -> None:
    """Make every parameter of `model` a DTensor over `tp_mesh` as `placements` says (absent: R),
    in place, tied parameters staying tied; install the module-boundary reductions and the output
    conversion. Parameter values are not moved: `runtime.init.materialize` fills the local shards."""
    converted: dict[int, nn.Parameter] = {}
    owners: list[nn.Module] = []
    for path, module in model.named_modules(remove_duplicate=False):
        sharded_here = False
        for attr, param in list(module._parameters.items()):
            if param is None:
                continue
            name = f"{path}.{attr}" if path else attr
            if id(param) not in converted:
                placement = placement_of(placements.get(name, "R"))
                converted[id(param)] = nn.Parameter(_meta_dtensor(param, tp_mesh, placement),
                                                    requires_grad=param.requires_grad)
            new = converted[id(param)]
            module._parameters[attr] = new
            sharded_here |= not new.placements[0].is_replicate()
        if sharded_here and all(module is not o for o in owners):
            owners.append(module)
    for module in owners:
        module.register_forward_hook(_reduce_partial_outputs)
    model.register_forward_hook(_plain_outputs(vocab_parallel_logits))


def step_context() -> contextlib.AbstractContextManager:
    """Entered around each micro-batch's forward and backward: plain tensors count as replicated."""
    return implicit_replication()


def _meta_dtensor(param: torch.Tensor, mesh: DeviceMesh, placement) -> DTensor:
    """A DTensor with `param`'s global shape and this rank's local shape, its storage on meta."""
    shape = param.shape
    if isinstance(placement, Shard):
        dim = placement.dim
        if not 0 <= dim < len(shape):
            raise AutoparError(f"placement S({dim}) over tp names a dimension a {len(shape)}-D parameter lacks")
        local_shape = list(shape)  # torch.chunk's split, as DTensor shards: the last ranks may hold fewer rows
        local_shape[dim], _ = Shard.local_shard_size_and_offset(shape[dim], mesh.size(), mesh.get_local_rank())
    else:
        local_shape = list(shape)
    local = torch.empty(local_shape, dtype=param.dtype, device="meta")
    return DTensor.from_local(local, mesh, (placement,), run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _reduce_partial_outputs(_module, _args, output):
    return tree_map_only(DTensor, _reduced, output)


def _reduced(tensor: DTensor) -> DTensor:
    if not any(p.is_partial() for p in tensor.placements):
        return tensor
    mesh = tensor.device_mesh
    placements = [Replicate() if p.is_partial() else p for p in tensor.placements]
    reduced = tensor.redistribute(mesh, placements)
    if any(isinstance(p, _MaskPartial) for p in tensor.placements):
        # A vocabulary-parallel lookup's backward takes its gradient whole: one whose gradient
        # arrives as partial sums (consumers summing into it) is reduced here first (Megatron's g),
        # since DTensor cannot turn one kind of partial sum into the lookup's masked one.
        reduced = DTensor.from_local(reduced.to_local(), mesh, placements, run_check=False,
                                     shape=reduced.shape, stride=reduced.stride())
    return reduced


def _plain_outputs(vocab_parallel_logits: bool):
    def to_plain(tensor: DTensor):
        last = tensor.ndim - 1
        if vocab_parallel_logits and any(isinstance(p, Shard) and p.dim == last for p in tensor.placements):
            return tensor  # logits sharded over the vocabulary: the loss runs under loss_parallel
        replicated = tensor.redistribute(tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim)
        return replicated.to_local()

    def hook(_module, _args, output):
        return tree_map_only(DTensor, to_plain, output)

    return hook
