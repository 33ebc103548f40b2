"""DTensor handling torch 2.13 lacks: CPU attention, and two gaps met on convolutional stems.

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

Smaller gaps (see `register`): a convolution whose input is split over channels (gathered first), a
convolution's backward whose input was a plain tensor, weight normalization's backward, which has
no rule (computed replicated), and a pooler's in-place restride of size-1 dims (and its backward).

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


def _with_plain_conv_args_replicated(handler):
    """DTensor's convolution backward handler asserts that the gradient and the input are DTensors;
    a convolution whose input was a plain tensor (an audio or image stem reading the batch, implicitly
    replicated in forward) saves it plain. Enter plain tensors as replicated, then hand over."""

    def convolution_backward(op_call, args, kwargs):
        mesh = next(a.device_mesh for a in args if isinstance(a, DTensor))
        replicated = (Replicate(),) * mesh.ndim
        args = tuple(DTensor.from_local(a, mesh, replicated, run_check=False)
                     if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)
        source = args[1]
        if not any(isinstance(p, Shard) and p.dim == source.ndim - 1 for p in source.placements):
            # A convolution that ran replicated (DTensor's handler only knows the spatially sharded
            # one; autograd saved the input as it came, before it was gathered): the gradient and
            # input are made whole and every rank computes the same gradients.
            local = [a.redistribute(mesh, replicated).to_local() if isinstance(a, DTensor) else a for a in args]
            outputs = op_call(*local, **kwargs)
            return tuple(None if out is None else DTensor.from_local(out, mesh, replicated, run_check=False)
                         for out in outputs)
        return handler(op_call, args, kwargs)

    return convolution_backward


def _with_unsupported_conv_inputs_replicated(handler):
    """DTensor's convolution handler shards a convolution only along its input's last (spatial) dim;
    an input split over channels (a column-parallel projection before a positional convolution) or
    batch is gathered first, as a replicated input, which the handler runs."""

    def convolution(op_call, args, kwargs):
        source = args[0]
        if isinstance(source, DTensor) and any(isinstance(p, Shard) and p.dim != source.ndim - 1
                                               for p in source.placements):
            placements = [Replicate() if isinstance(p, Shard) and p.dim != source.ndim - 1 else p
                          for p in source.placements]
            args = (source.redistribute(source.device_mesh, placements), *args[1:])
        return handler(op_call, args, kwargs)

    return convolution


def _as_strided_in_place(op_call, args, kwargs):
    """`as_strided_` on a DTensor, for the one use it gets in models: `adaptive_avg_pool2d` to 1×1
    (a pooler's mean) restrides its output in place to a memory format, which for a tensor whose
    spatial dims have size 1 changes only strides of size-1 dims: no data moves, nothing to do.
    Anything else is refused as DTensor refuses `as_strided`."""
    tensor, size, stride = args[0], tuple(args[1]), tuple(args[2])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    if tensor.size() == size and offset in (None, tensor.storage_offset()) and all(
            a == b or n == 1 for a, b, n in zip(tensor.stride(), stride, size)):
        return tensor
    raise RuntimeError("as_strided_ not supported with DTensor")


def _with_replicated_as_strided_local(handler):
    """`as_strided` (the backward of that restride takes one of its gradient) on each rank's whole
    copy: a sharded tensor is gathered first; replicated copies and partial sums are viewed as they
    are (the same view of each rank's copy is the view of the whole). DTensor's own handler takes
    only the identity view."""

    def as_strided(op_call, args, kwargs):
        tensor = args[0]
        if tuple(args[1]) == tuple(tensor.size()) and tuple(args[2]) == tuple(tensor.stride()):
            return handler(op_call, args, kwargs)
        if not all(p.is_replicate() or p.is_partial() for p in tensor.placements):
            tensor = tensor.redistribute(tensor.device_mesh, [p if p.is_partial() else Replicate()
                                                              for p in tensor.placements])
        local = op_call(tensor.to_local(), *args[1:], **kwargs)
        return DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False,
                                  shape=local.shape, stride=local.stride())

    return as_strided


def register() -> None:
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import register_op_strategy, replicate_op_strategy

    handlers = DTensor._op_dispatcher._custom_op_handlers
    handlers.setdefault(_FORWARD, _attention_handler)
    handlers.setdefault(_BACKWARD, _attention_handler)
    handlers.setdefault(aten.as_strided_.default, _as_strided_in_place)
    for op, wrap in ((aten.convolution.default, _with_unsupported_conv_inputs_replicated),
                     (aten.convolution_backward.default, _with_plain_conv_args_replicated),
                     (aten.as_strided.default, _with_replicated_as_strided_local)):
        if not getattr(handlers.get(op), "autopar", False):
            handlers[op] = wrap(handlers[op])
            handlers[op].autopar = True
    # Weight normalization's backward (Wav2Vec2's positional convolution) has no rule: its weights
    # are replicated (a convolution's are never sharded here), so compute it replicated.
    register_op_strategy(aten._weight_norm_interface_backward.default, schema_info=RuntimeSchemaInfo(4))(
        replicate_op_strategy)


register()
