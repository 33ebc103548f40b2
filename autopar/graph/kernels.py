"""The kernels a GPU runs, put in while tracing where the meta device would trace other ones.

On the meta device PyTorch decomposes `scaled_dot_product_attention` into the math path (bmm +
softmax, saving the T×T scores). GPUs run a fused kernel, so while tracing (`capture.trace`)
`GpuKernels` routes it to the fused flash (no mask) or memory-efficient (with mask) ATen op, whose
FLOP formulas and saved tensors are what a GPU step really has; with `attention="math"`, to the
unfused kernels software without a fused attention kernel runs. Dropout is traced as the fused
`native_dropout` CUDA uses, and grouped GEMM outside bf16 as `autopar::grouped_mm`
(`autopar.graph.grouped_mm`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from autopar.graph.attention import AttentionRecorder

_GROUPED_MM = {getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)} - {None}


class GpuKernels(TorchFunctionMode):
    """Trace the kernels a GPU runs where the meta device would decompose differently (see the
    module docstring): attention as one fused op, or with `attention="math"` as Megatron-style
    unfused kernels (batched matmul, softmax, dropout, batched matmul); dropout as the fused
    `native_dropout` CUDA uses. Grouped GEMM outside bf16, which torch's fake kernel (like the CUDA
    fast path) does not accept, is traced as `autopar::grouped_mm`."""

    def __init__(self, attention: str, recorder: AttentionRecorder | None = None) -> None:
        super().__init__()
        self.attention = attention
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GROUPED_MM and any(isinstance(a, torch.Tensor) and a.dtype != torch.bfloat16 for a in args[:2]):
            return _any_precision_grouped_mm(*args, **kwargs)
        if func is F.dropout:
            return _dropout(*args, **kwargs)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value = args[:3]
        rest = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), args[3:]))
        rest.update(kwargs)
        if self.recorder is not None:
            self.recorder.record(query, key, causal=bool(rest.get("is_causal", False)),
                                 masked=rest.get("attn_mask") is not None)
        if query.shape[-3] != key.shape[-3] and query.dim() == 4:  # grouped-query attention
            repeats = query.shape[-3] // key.shape[-3]
            key = key.repeat_interleave(repeats, dim=-3)
            value = value.repeat_interleave(repeats, dim=-3)
        dropout, causal, scale = rest.get("dropout_p", 0.0), rest.get("is_causal", False), rest.get("scale")
        mask = rest.get("attn_mask")
        if self.attention == "math":
            return _unfused_attention(query, key, value, mask, dropout, scale)
        if mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout, causal, False, scale=scale
            )[0]
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(~mask, float("-inf"))
        mask = mask.to(query.dtype).expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, mask, True, dropout, causal, scale=scale
        )[0]


def _any_precision_grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """Outside bf16, torch's fake kernel refuses grouped GEMM: trace autopar's (autopar.graph.grouped_mm)."""
    from autopar.graph.grouped_mm import grouped_mm

    if bias is not None or (out_dtype is not None and out_dtype != mat_a.dtype):
        raise NotImplementedError("grouped GEMM with a bias or another output dtype traces only in bf16: "
                                  "use precision='bf16'")
    return grouped_mm(mat_a, mat_b, offs)


def _dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    if not training or p == 0:
        return input
    return torch.ops.aten.native_dropout(input, p, True)[0]


def _unfused_attention(query, key, value, mask, dropout: float, scale: float | None) -> torch.Tensor:
    """Scores materialized: QKᵀ (scale folded in, as baddbmm's alpha does), one softmax kernel
    (scaling and masking fused into it, as Megatron-LM's fused softmax does), dropout, then ·V."""
    *batch, length, dim = query.shape
    rows = math.prod(batch)
    q = query.reshape(rows, length, dim)
    k = key.reshape(rows, key.shape[-2], dim)
    v = value.reshape(rows, value.shape[-2], value.shape[-1])
    scores = torch.bmm(q, k.transpose(1, 2))
    if mask is not None and mask.dtype != torch.bool:
        scores = scores + mask.expand(*batch, length, key.shape[-2]).reshape(rows, length, key.shape[-2])
    probabilities = torch.softmax(scores, dim=-1)
    if dropout > 0:
        probabilities = torch.ops.aten.native_dropout(probabilities, dropout, True)[0]
    return torch.bmm(probabilities, v).reshape(*batch, length, value.shape[-1])
