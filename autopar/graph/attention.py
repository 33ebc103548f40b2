"""Attention calls as graph facts: what context parallelism (cp) shards and exchanges.

The traced graph holds each attention kernel as one op whose FLOPs torch counts, but not the
arguments cp is priced from: whether the call is causal (the zigzag's load balance needs it),
how many key/value heads the module projects before a grouped-query repeat (what a ring rotates
and an all-to-all re-shards), and whether the module is the zoo's attention, which the runtime's
context parallelism runs. The capture records every `scaled_dot_product_attention` call with the
module that made it (`AttentionRecorder`, fed by the capture's kernel mode, `kernels.GpuKernels`).
"""

from __future__ import annotations

from typing import Callable

from pydantic import BaseModel, ConfigDict
from torch import nn


class AttentionCall(BaseModel):
    """One scaled-dot-product attention of the traced forward (per layer, for the zoo's models)."""

    model_config = ConfigDict(frozen=True)

    module_path: str  # the module whose forward called it
    heads: int  # query heads
    kv_heads: int  # key/value heads as the module projects them (before a grouped-query repeat)
    head_dim: int
    seq_len: int  # query positions
    kv_seq_len: int
    causal: bool
    masked: bool  # an explicit attention mask was passed
    # The zoo's CausalSelfAttention (autopar.models.gpt), which the runtime's cp shards.
    autopar_attention: bool


class AttentionRecorder:
    """Collects the attention calls of one trace; `current_path()` names the module running."""

    def __init__(self, model: nn.Module, current_path: Callable[[], str]) -> None:
        self.model = model
        self.current_path = current_path
        self._calls: dict[tuple[str, int], AttentionCall] = {}
        self._per_module: dict[str, int] = {}

    def record(self, query, key, *, causal: bool, masked: bool) -> None:
        """A call on [batch, heads, positions, head_dim] tensors (others are not recorded)."""
        if query.dim() != 4 or key.dim() != 4:
            return
        path = self.current_path()
        from autopar.models.gpt import CausalSelfAttention

        module = self.model.get_submodule(path) if path else self.model
        ours = isinstance(module, CausalSelfAttention)
        kv_heads = module.kv_heads if ours else key.shape[-3]
        index = self._per_module.get(path, 0)
        self._per_module[path] = index + 1
        self._calls[(path, index)] = AttentionCall(
            module_path=path, heads=int(query.shape[-3]), kv_heads=int(kv_heads), head_dim=int(query.shape[-1]),
            seq_len=int(query.shape[-2]), kv_seq_len=int(key.shape[-2]), causal=bool(causal), masked=masked,
            autopar_attention=ours)

    def calls(self) -> list[AttentionCall]:
        return list(self._calls.values())
