"""MoE grouped GEMM in any precision, for tracing.

torch's fake (meta) kernel for `aten._grouped_mm` accepts bf16 only (the CUDA fast path's dtype), so
a Mixtral-style model planned in fp32 or fp16 could not be captured. Outside bf16 the capture calls
`autopar::grouped_mm` instead: the same contraction (a jagged operand's rows, split by `offs`, each
meet one group's matrix), with a shape-only fake kernel and the grouped GEMMs its backward runs, so
the graph holds the forward and backward contractions at the model's own dtype and their FLOPs
(`autopar.graph.flops`). Only the capture calls it; a real run uses torch's own kernels.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("autopar::grouped_mm", mutates_args=())
def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None) -> torch.Tensor:
    if offs is None:
        return torch.matmul(mat_a, mat_b)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if mat_a.dim() == 2 and mat_b.dim() == 3:  # rows of a split by offs, group g against b[g]
        return torch.cat([mat_a[s:e] @ mat_b[g] for g, (s, e) in enumerate(zip(starts, ends))])
    if mat_a.dim() == 2 and mat_b.dim() == 2:  # the contraction dimension split: one result per group
        return torch.stack([mat_a[:, s:e] @ mat_b[s:e] for s, e in zip(starts, ends)])
    raise NotImplementedError(f"grouped_mm of {mat_a.dim()}-D by {mat_b.dim()}-D operands with offsets")


@grouped_mm.register_fake
def _(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None) -> torch.Tensor:
    return mat_a.new_empty(output_shape(mat_a.shape, mat_b.shape, None if offs is None else offs.shape[0]))


def output_shape(a: torch.Size, b: torch.Size, groups: int | None) -> tuple[int, ...]:
    """torch's grouped GEMM shapes: 2-D x 3-D splits a's rows over the groups, 2-D x 2-D splits the
    contraction (one result per group), 3-D x 2-D splits b's columns, 3-D x 3-D is batched."""
    if len(a) == 2 and len(b) == 3:
        return (a[0], b[-1])
    if len(a) == 2 and len(b) == 2:
        return (groups, a[0], b[-1])
    if len(a) == 3 and len(b) == 2:
        return (a[-2], b[-1])
    return (a[0], a[-2], b[-1])


def _setup(ctx, inputs, output) -> None:
    mat_a, mat_b, offs = inputs
    ctx.save_for_backward(mat_a, mat_b, offs)


def _backward(ctx, grad):
    mat_a, mat_b, offs = ctx.saved_tensors
    if mat_a.dim() == 2 and mat_b.dim() == 3:  # y[rows of g] = a[rows of g] @ b[g]
        grad_a = grouped_mm(grad, mat_b.transpose(-2, -1), offs)
        grad_b = grouped_mm(mat_a.transpose(0, 1), grad, offs)
        return grad_a, grad_b, None
    if mat_a.dim() == 3 and mat_b.dim() == 3:  # batched: y[g] = a[g] @ b[g]
        return grad @ mat_b.transpose(-2, -1), mat_a.transpose(-2, -1) @ grad, None
    raise NotImplementedError(f"backward of grouped_mm of {mat_a.dim()}-D by {mat_b.dim()}-D operands")


grouped_mm.register_autograd(_backward, setup_context=_setup)
