"""DTensor handling torch 2.13 lacks for CPU attention.

`F.scaled_dot_product_attention` on CPU tensors lowers to
`aten._scaled_dot_product_flash_attention_for_cpu` (and its backward), which has no DTensor
sharding rule in torch 2.13: a tensor-parallel attention fails there with "does not have a
sharding strategy registered". We register a handler for both ops (not a decomposition: each
rank runs the same fused kernel on its share). Attention is independent per sample and per head,
so the tensors (batch, heads, ...) keep a batch or head sharding they arrive with (dim 0 or 1 of
the query) and are replicated on any other mesh dimension; key, value (and, in backward, the
output, its gradient and the log-sum-exp) are brought to the query's placement, a local slice
when they are replicated. The attention mask is a keyword argument, which DTensor's generic
dispatch never reshards, so a rule alone would hand the kernel a whole mask beside a shard of
the heads: the handler slices the mask itself where it has a batch or head dimension (size > 1)
and passes it whole where it broadcasts.

Importing this module registers the handlers (once per process).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

aten = torch.ops.aten
_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_SHARDABLE_DIMS = (0, 1)  # batch, heads


def _target_placements(query: DTensor) -> tuple:
    """Per mesh dim: the query's batch or head sharding where it divides evenly, else Replicate."""
    mesh = query.device_mesh
    result = []
    for mesh_dim, placement in enumerate(query.placements):
        keep = (isinstance(placement, Shard) and placement.dim in _SHARDABLE_DIMS
                and query.shape[placement.dim] % mesh.size(mesh_dim) == 0)
        result.append(placement if keep else Replicate())
    return tuple(result)


def _local_mask(mask, mesh, placements: tuple):
    """This rank's part of an attention mask (right-aligned against (batch, heads, q, k))."""
    if mask is None:
        return None
    if isinstance(mask, DTensor):
        mask = mask.redistribute(mesh, (Replicate(),) * mesh.ndim).to_local()
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            own = mask.dim() - 4 + placement.dim
            if own >= 0 and mask.shape[own] > 1:
                size = mask.shape[own] // mesh.size(mesh_dim)
                mask = mask.narrow(own, mesh.get_local_rank(mesh_dim) * size, size)
    return mask


def _attention_handler(op_call, args, kwargs):
    """Run the CPU flash-attention kernel (forward or backward) on each rank's share of the heads/batch."""
    query_index = 0 if op_call is _FORWARD else 1
    query = args[query_index]
    mesh = query.device_mesh
    placements = _target_placements(query)
    tensor_count = 3 if op_call is _FORWARD else 6
    global_shapes, local_args = [], []
    for index, arg in enumerate(args):
        if index < tensor_count:
            if not isinstance(arg, DTensor):  # a plain tensor (implicitly replicated)
                arg = DTensor.from_local(arg, mesh, (Replicate(),) * mesh.ndim, run_check=False)
            global_shapes.append(arg.shape)
            local_args.append(arg.redistribute(mesh, placements).to_local())
        else:
            local_args.append(arg)
    local_kwargs = dict(kwargs)
    local_kwargs["attn_mask"] = _local_mask(kwargs.get("attn_mask"), mesh, placements)
    outputs = op_call(*local_args, **local_kwargs)
    if op_call is _FORWARD:
        q_shape, v_shape = global_shapes[0], global_shapes[2]
        shapes = [(*q_shape[:-1], v_shape[-1]), tuple(q_shape[:-1])]  # output, logsumexp
    else:
        shapes = [tuple(s) for s in global_shapes[1:4]]  # grad query, key, value
    return tuple(_wrap(local, mesh, placements, shape) for local, shape in zip(outputs, shapes))


def _wrap(local: torch.Tensor, mesh, placements: tuple, shape) -> DTensor:
    stride = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    if local.is_contiguous():
        stride = tuple(reversed(stride))
    else:  # keep the kernel's layout: global strides scaled as its local strides are
        stride = _scaled_stride(local, shape)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def _scaled_stride(local: torch.Tensor, shape) -> tuple[int, ...]:
    """Strides of a tensor of `shape` laid out in the same dimension order as `local`."""
    order = sorted(range(local.dim()), key=lambda d: local.stride(d))  # innermost first
    stride = [0] * local.dim()
    running = 1
    for dim in order:
        stride[dim] = running
        running *= shape[dim]
    return tuple(stride)


def register() -> None:
    DTensor._op_dispatcher._custom_op_handlers.setdefault(_FORWARD, _attention_handler)
    DTensor._op_dispatcher._custom_op_handlers.setdefault(_BACKWARD, _attention_handler)


register()
