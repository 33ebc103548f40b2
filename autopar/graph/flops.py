"""Per-op work: tensor-core FLOPs from torch's own formulas, rough vector work, bytes moved.

Torch's FLOP counter (torch.utils.flop_counter) is the reference the field uses for matmul,
convolution and attention FLOPs, so we reuse its registry rather than keep a second set of formulas.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from autopar.graph import grouped_mm as _any_precision  # noqa: F401  registers torch.ops.autopar.grouped_mm

# Ops that move or allocate data but do no arithmetic.
_NO_MATH = {
    "clone", "copy", "copy_", "_to_copy", "cat", "stack", "empty", "empty_like", "zeros", "zeros_like",
    "ones", "ones_like", "full", "full_like", "arange", "scalar_tensor", "new_empty", "new_zeros",
    "new_ones", "new_full", "embedding", "index_select", "gather", "index", "constant_pad_nd",
    "repeat", "lift_fresh_copy", "_unsafe_view", "contiguous", "fill", "fill_", "zero_",
    "slice_scatter", "select_scatter", "bernoulli", "rand", "randn", "rand_like", "tril", "triu",
}
# Reductions and normalizations: about this many operations per input element.
_PER_INPUT_ELEMENT = {
    "sum": 1, "mean": 1, "amax": 1, "amin": 1, "max": 1, "min": 1, "var": 3, "var_mean": 3,
    "std": 3, "norm": 2, "_softmax": 5, "_log_softmax": 5, "_safe_softmax": 5,
    "_softmax_backward_data": 3, "_log_softmax_backward_data": 3, "native_layer_norm": 8,
    "native_layer_norm_backward": 12, "nll_loss_forward": 1, "nll_loss_backward": 1,
    "embedding_dense_backward": 1, "native_batch_norm": 8, "native_batch_norm_backward": 12,
    "_native_batch_norm_legit_functional": 8, "native_group_norm": 8,
    "native_group_norm_backward": 12, "cumsum": 1, "topk": 2, "sort": 8, "scatter_add": 1,
    "index_add": 1, "index_put": 1, "_fused_rms_norm": 5, "_fused_rms_norm_backward": 8,
}


def _grouped_mm_flops(mat_a, mat_b, *args, out_val=None, **kwargs) -> int:
    """MoE grouped GEMM (absent from torch's registry): each row of the jagged operand meets one
    group's matrix, so the work is one plain matmul over all rows, whatever the split."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:  # jagged contraction (weight gradient): (M, ΣK) × (ΣK, N)
        return 2 * mat_a.shape[0] * mat_a.shape[1] * mat_b.shape[1]
    return 2 * out_val.numel() * mat_a.shape[-1]


_EXTRA_FORMULAS = {torch.ops.aten._grouped_mm: _grouped_mm_flops, torch.ops.autopar.grouped_mm: _grouped_mm_flops}


def op_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    return str(target)


def is_view(target: Any) -> bool:
    """True for ops whose output aliases an input (the schema says so), plus `_unsafe_view`."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    if target.overloadpacket.__name__ in ("_unsafe_view", "lift_fresh"):
        return True
    return bool(schema.returns) and all(
        ret.alias_info is not None and not ret.alias_info.is_write for ret in schema.returns
    )


def tensor_flops(target: Any, args: tuple, kwargs: dict, out: Any) -> int:
    packet = getattr(target, "overloadpacket", None)
    formula = flop_registry.get(packet) or _EXTRA_FORMULAS.get(packet)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


def vector_flops(target: Any, input_numels: list[int], output_numels: list[int]) -> int:
    packet = getattr(target, "overloadpacket", None)
    if packet is None or packet in flop_registry or packet in _EXTRA_FORMULAS:
        return 0
    name = packet.__name__
    if name in _PER_INPUT_ELEMENT:
        return _PER_INPUT_ELEMENT[name] * (max(input_numels) if input_numels else 0)
    if name in _NO_MATH:
        return 0
    if torch.Tag.pointwise in getattr(target, "tags", ()):
        return max(output_numels) if output_numels else 0
    return 0
