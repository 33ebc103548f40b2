"""Data parallelism and ZeRO over the dp axis.

- zero 0: replicated parameters; gradients all-reduced (averaged) over dp in buckets after the
  last micro-batch's backward.
- zero 1 and 2: FSDP2 without resharding after forward: parameters are gathered once per step and
  kept through backward, gradients reduce-scattered, optimizer states sharded. Zero 1 reduces once
  after the last micro-batch; zero 2 reduce-scatters every micro-batch so only shards of the
  gradients persist.
- zero 3: FSDP2 resharding after forward (parameters gathered again for backward).
Under a pipeline schedule, torch's stage drives FSDP2's gradient sync itself (last backward only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

BUCKET_BYTES = 25 * 2**20


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, zero: int, block_paths: list[str],
               mixed_precision: MixedPrecisionPolicy | None) -> None:
    """FSDP2 per block (one gather/scatter unit each), then the rest of the module as the root unit."""
    options = {"mesh": dp_mesh, "reshard_after_forward": zero >= 3}
    if mixed_precision is not None:
        options["mp_policy"] = mixed_precision
    for path in block_paths:
        fully_shard(model.get_submodule(path), **options)
    fully_shard(model, **options)


def set_microbatch_boundary(modules: list[nn.Module], zero: int, last: bool) -> None:
    """Before a micro-batch's backward: what FSDP does at its end.

    ZeRO 1 reduce-scatters gradients only after the last micro-batch (ZeRO 2/3 every one, which is
    what keeps their gradients sharded); ZeRO 1/2 keep the gathered weights until the last
    micro-batch (one all-gather per step, as torch's pipeline schedules also do, and as their
    memory model holds the full weights); ZeRO 3 frees them after every backward.
    """
    for module in modules:
        if isinstance(module, FSDPModule):
            if zero < 2:
                module.set_requires_gradient_sync(last)
            if zero < 3:
                module.set_reshard_after_backward(last)


def all_reduce_gradients(params: list[nn.Parameter], group: dist.ProcessGroup, size: int) -> None:
    """Average replicated gradients over the dp group, flattened into buckets of at most BUCKET_BYTES."""
    if size == 1:
        return
    grads = [_local(p.grad) for p in params if p.grad is not None]
    bucket: list[torch.Tensor] = []
    filled = 0
    for grad in grads:
        bucket.append(grad)
        filled += grad.numel() * grad.element_size()
        if filled >= BUCKET_BYTES:
            _reduce_bucket(bucket, group, size)
            bucket, filled = [], 0
    if bucket:
        _reduce_bucket(bucket, group, size)


def _reduce_bucket(grads: list[torch.Tensor], group: dist.ProcessGroup, size: int) -> None:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for grad in same:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
