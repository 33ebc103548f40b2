"""Model configuration shared by the built-in transformer families."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from autopar.errors import AutoparError


class TransformerConfig(BaseModel):
    """Shape of a decoder-only transformer; one object describes both built-in families."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # `rope_theta=inf` is no shape

    family: Literal["gpt", "llama"] = "gpt"
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    kv_heads: int | None = None  # None: as many as heads (multi-head attention)
    ffn_hidden: int | None = None  # None: 4*hidden (gpt) or the Llama rounding rule
    vocab: int = 50257
    # Embedding and head rows are padded to a multiple of this (Megatron-LM's
    # --make-vocab-size-divisible-by, default 128): a GEMM of width 50,257 runs a fallback kernel on an
    # H100 (37.5 ms of a 423 ms GPT-1.3B step, ../shared/gpu/h100-2026-11-26.json), one of 50,304 does
    # not. The padded logits are masked to -inf, so the loss and every real gradient are unchanged.
    vocab_multiple: int = 128
    seq_len: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool | None = None  # None: tied for gpt, untied for llama
    dropout: float = 0.0
    init_std: float = 0.02
    # Mixture of experts (`autopar.models.moe`): every block's MLP becomes `moe_experts` experts with
    # a top-`moe_top_k` router; `moe_capacity_factor` pads each expert's queue per sequence (None:
    # to the sequence length, nothing dropped).
    moe_experts: int | None = None
    moe_top_k: int = 2
    moe_capacity_factor: float | None = None

    @model_validator(mode="after")
    def _check(self) -> "TransformerConfig":
        for name in ("layers", "hidden", "heads", "vocab", "seq_len", "kv_heads", "ffn_hidden", "norm_eps",
                     "rope_theta", "init_std", "moe_experts", "vocab_multiple"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be at least 0 and below 1, got {self.dropout}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.num_kv_heads:
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads ({self.num_kv_heads})")
        if self.moe_experts is not None and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"moe_top_k ({self.moe_top_k}) must be between 1 and moe_experts ({self.moe_experts})")
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            raise ValueError(f"moe_capacity_factor must be positive, got {self.moe_capacity_factor}")
        if self.family == "llama" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {self.head_dim}")
        return self

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and the head: the vocabulary rounded up to `vocab_multiple`."""
        return -(-self.vocab // self.vocab_multiple) * self.vocab_multiple

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.family == "gpt":
            return 4 * self.hidden
        # Llama: 2/3 of 4h, rounded up to a multiple of 256 (Touvron et al. 2023, SwiGLU sizing).
        size = int(2 * 4 * self.hidden / 3)
        return 256 * ((size + 255) // 256)

    @property
    def tied(self) -> bool:
        return self.tie_embeddings if self.tie_embeddings is not None else self.family == "gpt"


def parse_overrides(text: str | None) -> dict[str, object]:
    """Parse `k=v,k=v` into typed values (int, float, bool, None, else str)."""
    if not text:
        return {}
    overrides: dict[str, object] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise AutoparError(
                f"--model-config item {item!r} is not key=value: write e.g. --model-config layers=4,hidden=256"
            )
        key, raw = (part.strip() for part in item.split("=", 1))
        if not key:
            raise AutoparError(f"--model-config item {item!r} has no key: write e.g. --model-config layers=4,hidden=256")
        if key in overrides:
            raise AutoparError(f"--model-config sets {key} twice: give each key once")
        overrides[key] = _coerce(raw)
    return overrides


def _coerce(raw: str) -> object:
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw
