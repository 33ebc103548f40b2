"""torch.compile of a stage: its whole forward with the loss where the plan allows, else each block.

Whole stage (`compile_forward_loss`): one graph from token ids to the loss, as the fastest hand-written
baseline compiles (GPT-1.3B on an H100, eager 420.9 ms, `torch.compile(model)` 316.8 ms, per-block
399.3 ms: ../shared/gpu/h100-2026-11-26.json). It fuses the embedding, the head, the padded-vocabulary
mask and the loss's fp32 logits, and it cuts the kernels launched per step. It needs a stage that is
the whole model on plain tensors: no pipeline cut (a schedule calls the stage and the loss apart), no
DTensor (tp, cp), no FSDP2 unit hooks (zero >= 1) and no expert all-to-alls
(`autopar.capabilities.whole_stage_problem`, which the cost model reads too).

Per block (`compile_blocks`), everywhere else: every block of a model runs the same code, so the compiled
graph is shared and compile time does not grow with depth; a whole-model graph would also have to
swallow the embedding, the head and the pipeline's stage cuts. Replacing the instance's `forward`
(not the module, not `__call__`) keeps parameter names unchanged (plans, checkpoints and placements
keep working) and leaves the module hooks of FSDP2 outside the compiled code, running eagerly
around it; the recompute wrapper, when there is one, is the forward that gets compiled, so the
checkpoint region is traced as one unit. Pipeline stages compile the blocks they hold, the same way.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._pytree import tree_map_only

from autopar.errors import AutoparError
from autopar.runtime.recompute import checkpointed_inside

# Blocks share one compiled graph when their guards agree (seen: 12 zoo GPT blocks, with and without
# recompute, one graph). Blocks that differ (say, per-layer attention windows) need an entry each:
# past dynamo's default of 8 the rest would silently run eagerly.
_MIN_CACHE_ENTRIES = 64


def compile_forward_loss(module: nn.Module, loss_fn, *, backend: str = "inductor"):
    """One compiled function from a micro-batch to its loss: `loss_fn(module(x), x)`."""
    def forward_loss(x: torch.Tensor) -> torch.Tensor:
        return loss_fn(module(x), x)

    return torch.compile(forward_loss, backend=backend)


def compile_blocks(module: nn.Module, block_paths: list[str], *, backend: str = "inductor",
                   split_backward: bool = False, inside_checkpoint: bool = False) -> list[str]:
    """Compile the forward of each listed block present in `module`; returns the paths compiled.

    `split_backward`: the schedule differentiates each stage twice over one graph (zero-bubble: input
    gradients with the graph retained, then weight gradients). A compiled backward that donates its
    saved buffers refuses a retained graph (torch 2.13 raised mid-step), so donation is turned off for
    the process, as TorchTitan's graph pipeline does for its V schedules. Donation only lets inductor
    reuse dead saved buffers in backward; the cost model does not count it.

    `inside_checkpoint`: a recomputed block compiles the function its checkpoint calls, and the checkpoint
    runs eagerly around it, instead of compiling the checkpoint with it. Under tp with full recompute a
    compiled checkpoint saved the device mesh among its tensors for the recomputation and failed
    (torch 2.13: "expected all tensors_saved_with_vc_check to be Tensors"); the recomputation then runs
    the compiled forward again, as eager full recompute runs the forward again."""
    def compiled_form(forward):
        return _settled_inputs(torch.compile(forward, backend=backend))

    present = dict(module.named_modules())
    done = []
    for path in block_paths:
        block = present.get(path)
        if block is None:
            continue
        if getattr(block.forward, "_autopar_compiled", False):
            raise AutoparError(f"block {path} is already compiled: parallelize a fresh model")
        inner = checkpointed_inside(block.forward, compiled_form) if inside_checkpoint else None
        compiled = inner if inner is not None else compiled_form(block.forward)
        compiled._autopar_compiled = True
        block.forward = compiled
        done.append(path)
    if done and split_backward:
        torch._functorch.config.donated_buffer = False
    if done:
        config = torch._dynamo.config
        key = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # the newer name
        setattr(config, key, max(getattr(config, key), _MIN_CACHE_ENTRIES, 2 * len(done)))
    return done


class _Settle(torch.autograd.Function):
    """Wait for an async collective's result and hand on the plain tensor; the gradient passes as it is."""

    @staticmethod
    def forward(ctx, x: AsyncCollectiveTensor) -> torch.Tensor:
        return x.trigger_wait().view(x.shape)  # a view: the waited tensor's own autograd history stays as it is

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _settled_inputs(compiled):
    """`compiled` called with every async collective result among its arguments (nested ones too) waited
    for first.

    A row-parallel output handed on as a local tensor (tp without sp: the embedding's, a block's) is an
    AsyncCollectiveTensor. Entering a compiled graph as such, its gradient came back as a plain tensor
    where the collective's backward expects a DTensor, and backward failed (torch 2.13; a Llama block
    reads the embedding's output directly, where a GPT block reads its sum with the positions).
    """
    def forward(*args, **kwargs):
        args, kwargs = tree_map_only(AsyncCollectiveTensor, _Settle.apply, (args, kwargs))
        return compiled(*args, **kwargs)

    return forward
