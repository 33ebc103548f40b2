"""Activation recompute on the modules the plan lists, without renaming them.

The module's forward is replaced by a checkpointed call of the original, so parameter names (and
checkpoints, and plan placements) stay those of the unwrapped model. `full` keeps only the block's
input; `selective` also keeps the outputs of matmuls, attention and tensor-parallel collectives
and recomputes the rest (the elementwise work the cost model's selective policy drops).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.errors import AutoparError

_SAVED_OPS = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default, torch.ops.aten.linear.default,
    # Every fused attention SDPA may pick: on the H100 and H200 (torch 2.11) it picks cuDNN's, which
    # this list once lacked, so selective recompute repeated attention there, unpriced.
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._flash_attention_forward.default, torch.ops.aten._efficient_attention_forward.default,
    # Tensor-parallel collectives: recomputing one would resend it (selective recompute repeats compute only).
    torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default, torch.ops._c10d_functional.wait_tensor.default,
    torch.ops._c10d_functional.all_to_all_single.default,  # expert parallelism's dispatch and combine
}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recompute(model: nn.Module, module_paths: list[str], policy: str) -> list[str]:
    """Checkpoint each listed module present in `model` (a stage may hold only some); returns those done."""
    if policy == "none":
        return []
    if policy not in ("full", "selective"):
        raise AutoparError(f"unknown recompute policy {policy!r}: use none, selective or full")
    done = []
    present = dict(model.named_modules())
    for path in module_paths:
        module = present.get(path)
        if module is None:
            continue
        context = (functools.partial(create_selective_checkpoint_contexts, _selective_policy)
                   if policy == "selective" else None)
        module.forward = _checkpointed(module.forward, context)
        done.append(path)
    return done


def _checkpointed(original, context):
    def forward(*args, **kwargs):
        extra = {"context_fn": context} if context is not None else {}
        return checkpoint(original, *args, use_reentrant=False, **extra, **kwargs)

    forward._autopar_checkpointed = (original, context)  # what `checkpointed_inside` rebuilds
    return forward


def checkpointed_inside(forward, transform):
    """`forward`, a checkpointed block's, rebuilt with `transform` applied to the function it checkpoints
    (compile: the checkpoint then runs eagerly around the compiled block); None when it is not one."""
    parts = getattr(forward, "_autopar_checkpointed", None)
    if parts is None:
        return None
    original, context = parts
    return _checkpointed(transform(original), context)
