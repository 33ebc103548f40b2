"""Tensor-parallel activations sent in autocast's low precision, as Megatron-LM sends them.

Under `torch.autocast` (fp32 parameters, bf16/fp16 matmuls; runtime/precision.py) three of the
module rules' activation collectives would otherwise carry fp32, where the analytic ledger
(cost_models/collectives.py) and Megatron-LM send the low precision:
- a block's input (a LayerNorm output, fp32): its backward all-reduce (reduce-scatter under sp)
  sums the projections' input gradients in fp32, and under sp its forward all-gather is fp32;
- the head's input likewise;
- a vocabulary-parallel embedding's partial output (an fp32 lookup of fp32 weights): its forward
  all-reduce (reduce-scatter under sp).
Here each is cast to the autocast dtype before it becomes a DTensor, so those collectives run in
that dtype. Numerics: the projections reading a block's (or the head's) input would cast it to
the same dtype anyway, so their forward is unchanged; in backward the partial input gradients are
summed in the low precision before the cast back to fp32 (Megatron's bf16 sum). The embedding's
output is its rows rounded to the low precision (only one rank holds each token's row, so the sum
adds exact zeros), then cast back to the dtype it had, as bf16 weights (FSDP2's bf16 parameters,
Megatron) give it. With fp32 (no autocast) or low-precision parameters (FSDP2, zero 3: the tensors
already carry the low dtype) nothing is cast.

A block input read by anything but its column-parallel projections (a residual or a norm inside the
block) would see the rounded value in forward: such a block is refused (`ProjectionsOnly`) by the
dry run the plan was searched with (`checking_block_inputs`); training does not pay for the check
(a torch-function mode around every op of every block).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from autopar.errors import AutoparError


def autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The low dtype autocast computes `tensor`'s matmuls in, when it is on and `tensor` is fp32; else None."""
    device = tensor.device.type
    if tensor.dtype != torch.float32 or not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    return dtype if dtype != torch.float32 else None


def to_autocast_dtype(tensor: torch.Tensor) -> torch.Tensor:
    low = autocast_dtype(tensor)
    return tensor if low is None else tensor.to(low)


class LowPrecisionInput(ParallelStyle):
    """`style` (the head's ColwiseParallel) with its module's first input cast to the autocast dtype first."""

    def __init__(self, style: ParallelStyle) -> None:
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def cast(_module, args):
            if args and isinstance(args[0], torch.Tensor):
                return (to_autocast_dtype(args[0]), *args[1:])
            return None

        module.register_forward_pre_hook(cast)  # before the style's own input hook
        self.style.src_data_rank = self.src_data_rank
        return self.style._apply(module, device_mesh)


class LowPrecisionPartialOutput(ParallelStyle):
    """`style` (a vocabulary-parallel embedding's RowwiseParallel) whose partial output is cast to the
    autocast dtype before its all-reduce (or reduce-scatter), and back to its own dtype after."""

    def __init__(self, style: ParallelStyle) -> None:
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        dtypes: list[torch.dtype] = []  # the output's dtype, from the first hook to the last

        def cast(_module, _args, output):
            dtypes.append(output.dtype)
            low = autocast_dtype(output)
            if low is None or not isinstance(output, DTensor):
                return output
            # On the local shard: DTensor casts a (masked) partial by reducing it first, in fp32. The
            # gradient is replicated either way (from_local of a partial), so backward is unchanged.
            return DTensor.from_local(output.to_local().to(low), output.device_mesh, output.placements,
                                      run_check=False, shape=output.shape, stride=output.stride())

        def cast_back(_module, _args, output):
            return output.to(dtypes.pop())

        module.register_forward_hook(cast)  # before the style's output hook (the collective)
        self.style.src_data_rank = self.src_data_rank
        module = self.style._apply(module, device_mesh)
        module.register_forward_hook(cast_back)
        return module


_CHECKING: list[bool] = [False]


@contextlib.contextmanager
def checking_block_inputs():
    """Within: blocks check what reads their cast input (`ProjectionsOnly`); the tp dry run enters it."""
    before = _CHECKING[0]
    _CHECKING[0] = True
    try:
        yield
    finally:
        _CHECKING[0] = before


def block_inputs_checked() -> bool:
    return _CHECKING[0] and not torch.compiler.is_compiling()


# What reads no value: metadata, and autograd plumbing (hooks a module tracker registers on inputs).
_METADATA = frozenset({"shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "layout", "size", "dim",
                       "numel", "stride", "is_floating_point", "is_contiguous", "__len__", "grad_fn", "is_leaf",
                       "register_hook"})


class ProjectionsOnly(TorchFunctionMode):
    """While a block's forward runs: its cast input may be read only by linear projections (and its
    metadata); anything else reading it is refused with the block's name."""

    def __init__(self, block_input: torch.Tensor, block: str) -> None:
        super().__init__()
        self.block_input = block_input
        self.block = block

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(getattr(func, "__self__", None), "__name__", None) if func.__name__ == "__get__" \
            else func.__name__
        if func is not torch.nn.functional.linear and name not in _METADATA and any(
                leaf is self.block_input for leaf in tree_flatten((args, kwargs))[0]):
            raise AutoparError(
                f"tensor-parallel block {self.block} reads its input in {name} besides its linear projections: under "
                f"autocast the runtime sends a block's input in the low precision (cast once, as Megatron-LM), which "
                f"would round what {name} reads; train in fp32, or keep {self.block}'s linears replicated")
        return func(*args, **kwargs)
