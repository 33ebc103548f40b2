"""Megatron-style GPT: learned positions, pre-LayerNorm, GeLU MLP, tied head.

Separate q/k/v projections (rather than one fused matrix) keep every linear a plain column- or
row-parallel candidate for tensor parallelism.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.config import TransformerConfig
from autopar.models.moe import MoE
from autopar.models.vocab import mask_padded_logits


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        kv_width = self.kv_heads * self.head_dim
        bias = config.family == "gpt"
        self.q_proj = nn.Linear(config.hidden, config.hidden, bias=bias)
        self.k_proj = nn.Linear(config.hidden, kv_width, bias=bias)
        self.v_proj = nn.Linear(config.hidden, kv_width, bias=bias)
        self.out_proj = nn.Linear(config.hidden, config.hidden, bias=bias)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        y = self.attend(q, k, v)
        return self.out_proj(y.transpose(1, 2).reshape(batch, seq, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over [batch, heads, seq, head_dim]; k and v carry the kv heads. Context
        parallelism (`runtime.context_parallel`) replaces it per instance with attention over sequence
        shards, which is why the kv heads are shared across their query groups only here."""
        if k.shape[1] != q.shape[1]:  # grouped-query attention: share each kv head across its group
            repeats = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary embedding in the rotate-half form (real arithmetic, so DTensor and meta handle it)."""
    cos, sin = rope
    seq = x.shape[-2]
    cos, sin = cos[:seq].to(x.dtype), sin[:seq].to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return x * cos + rotated * sin


class GeluMLP(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden, config.ffn_size)
        self.fc2 = nn.Linear(config.ffn_size, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class GPTBlock(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.mlp = MoE(config) if config.moe_experts else GeluMLP(config)
        self.dropout = residual_dropout(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln1(x)))
        return x + self.dropout(self.mlp(self.ln2(x)))


def residual_dropout(config: TransformerConfig) -> nn.Module:
    """Dropout on residual branches and embeddings (GPT-2/Megatron style); absent at p=0 so a
    dropout-free model traces and runs no dropout ops at all."""
    return nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()


class GPT(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.padded_vocab, config.hidden)
        self.pos_embed = nn.Embedding(config.seq_len, config.hidden)
        self.embed_dropout = residual_dropout(config)
        # A dict keyed by index, so a pipeline stage that drops some layers keeps the others' names.
        self.layers = nn.ModuleDict({str(i): GPTBlock(config) for i in range(config.layers)})
        self.final_norm = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.head = nn.Linear(config.hidden, config.padded_vocab, bias=False)
        if config.tied:
            self.head.weight = self.embed.weight
        # Global positions of the tokens the next forward sees; None: 0..seq-1. Context parallelism
        # (`runtime.context_parallel`) sets them to a sequence shard's positions.
        self.position_ids: torch.Tensor | None = None
        init_transformer_weights(self, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids to logits; a pipeline stage (parts set to None) maps its input to its output."""
        if self.embed is not None:
            positions = torch.arange(x.shape[1], device=x.device) if self.position_ids is None else self.position_ids
            x = self.embed_dropout(self.embed(x) + self.pos_embed(positions))
        for layer in self.layers.values():
            x = layer(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return mask_padded_logits(self.head(x), self.config.vocab) if self.head is not None else x

    def init_module_(self, path: str, module: nn.Module) -> None:
        """Initialize one module's own tensors: the runtime's per-module, sharding-independent init."""
        init_module_weights(path, module, self.config)


def init_transformer_weights(model: nn.Module, config: TransformerConfig) -> None:
    """GPT-2 style init: N(0, std) weights, zero biases, output projections scaled by 1/sqrt(2L).

    Deterministic for a given torch seed, so a sharded run can rebuild the same weights. A model
    whose tensors are all on meta holds no values to set (and meta draws no random numbers): it is
    left as built, which saves about a second of dispatch on a 96-layer model when planning.
    """
    if all(tensor.is_meta for tensor in itertools.chain(model.parameters(), model.buffers())):
        return
    for name, module in model.named_modules():
        init_module_weights(name, module, config)


def init_module_weights(name: str, module: nn.Module, config: TransformerConfig) -> None:
    """The init rule for one module's own parameters (not its children's)."""
    out_std = config.init_std / math.sqrt(2 * config.layers)
    if isinstance(module, nn.Linear):
        is_output = name.endswith(("out_proj", "fc2", "down_proj"))
        nn.init.normal_(module.weight, mean=0.0, std=out_std if is_output else config.init_std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=config.init_std)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
    elif hasattr(module, "reset_parameters") and not list(module.children()):
        module.reset_parameters()
