"""The sum of squares of a list of tensors: the gradient norm's reduction, on any device.

On a GPU it is torch's foreach norm (a few fused launches). On the host, under optimizer offload,
that norm is one thread's work: torch's CPU kernel for a 2-norm over a contiguous last dimension
splits its work by output row (`binary_kernel_reduce_lastdim` in ATen's ReduceOpsKernel.cpp), and a
whole tensor reduced to one scalar is one row. On the lent H200s' 16-core hosts the fused CPU AdamW
stepped 3.84e9 parameters/s (7f4beee, about 108 GB/s), while AdamW after that norm made 1.27e9
(0621687, another instance; benchmarks/gpu_runs/): the norm, reading a seventh of AdamW's bytes,
took about twice its time (some 8 GB/s, one thread's rate). Viewing each tensor as rows of
`HOST_ROW_ELEMENTS` gives the kernel rows to spread over the host's threads.

Used by the runtime's clipping (`ParallelModel.clip_grad_norm_`) and by the host-rate measurement
that prices it (`autopar.host_rates`), so the two run the same reduction.
"""

from __future__ import annotations

import torch

HOST_ROW_ELEMENTS = 2**16  # 256 KiB of fp32 per row: past the per-row overhead, a few thousand rows per GiB
HOST_BLOCK_ROWS = 256  # rows reduced per call: a 16-bit block's fp32 copy stays at 64 MiB


def squares_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Σ x² over every element of `tensors` (all on one device), as an fp32 scalar on that device."""
    if not tensors:
        raise ValueError("squares_sum needs at least one tensor")
    if tensors[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(tensors, 2.0)).float().pow(2).sum()
    total = torch.zeros((), dtype=torch.float32)
    for tensor in tensors:
        total += _host_squares(tensor)
    return total


def _host_squares(tensor: torch.Tensor) -> torch.Tensor:
    """One host tensor's Σ x², by blocks of rows; a tensor that is not contiguous (never a gradient
    shard under offload) is reduced whole, as torch's norm does it, rather than copied."""
    accumulate = torch.promote_types(tensor.dtype, torch.float32)
    if not tensor.is_contiguous():
        return torch.linalg.vector_norm(tensor, 2.0, dtype=accumulate).square().float()
    flat = tensor.view(-1)
    rows = flat.numel() // HOST_ROW_ELEMENTS
    total = torch.zeros((), dtype=torch.float32)
    if rows:
        body = flat[: rows * HOST_ROW_ELEMENTS].view(rows, HOST_ROW_ELEMENTS)
        for block in body.split(HOST_BLOCK_ROWS):
            total += torch.linalg.vector_norm(block, 2.0, dim=1, dtype=accumulate).square().sum().float()
    tail = flat[rows * HOST_ROW_ELEMENTS:]
    if tail.numel():
        total += torch.linalg.vector_norm(tail, 2.0, dtype=accumulate).square().float()
    return total
