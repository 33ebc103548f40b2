"""Linear layers whose output width puts 16-bit GEMMs on a slow kernel, and the width the runtime
pads their products to.

A 16-bit GEMM with a dimension that is not a multiple of 8 elements misses cuBLAS's tensor-core
kernels (NVIDIA, "Matrix Multiplication Background User's Guide", Tensor Core requirements): on an
H100 the width-50,257 head of GPT-2's vocabulary ran a fallback kernel for 37.5 ms of a 430 ms step
(../shared/gpu). Megatron-LM pads the vocabulary in the model (make-vocab-size-divisible-by, 128);
autopar's zoo does too. A user's model keeps its own width: the runtime instead multiplies by the
weight padded with zero rows and slices the output back (`runtime/gemm_padding.py`). The first
`out_features` columns of x·[W; 0]ᵀ + [b; 0] are x·Wᵀ + b, and the slice's backward hands the padded
rows a zero gradient, so the loss, the gradients, the parameters and the state dict are those of the
model as built. Only where that is provably so:
- the module's class is `nn.Linear` itself (its forward is `F.linear`), with no hooks on it;
- `out_features` is misaligned and `in_features` aligned, so that all three GEMMs of the padded
  product (forward, input gradient, weight gradient) are aligned;
- it is wide (`MIN_PADDED_WIDTH`): a narrow product is short either way, and the pad and slice add
  kernels of their own.
"""

from __future__ import annotations

from torch import nn

PAD_MULTIPLE = 128  # Megatron-LM's make-vocab-size-divisible-by default
ALIGNMENT = 8  # elements: 16 bytes of a 16-bit type
MIN_PADDED_WIDTH = 1024


def paddable_linears(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Module path -> (out_features, the width its output is computed at), for each linear layer the
    runtime pads under 16-bit precision (where the plan's layout allows: `capabilities.gemm_padding_problem`)."""
    found = {}
    for path, module in model.named_modules():
        if type(module) is not nn.Linear or module._forward_hooks or module._forward_pre_hooks:
            continue
        width = module.out_features
        if width % ALIGNMENT and module.in_features % ALIGNMENT == 0 and width >= MIN_PADDED_WIDTH:
            found[path] = (width, -(-width // PAD_MULTIPLE) * PAD_MULTIPLE)
    return found
