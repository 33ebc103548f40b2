"""Llama-style decoder: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.config import TransformerConfig
from autopar.models.moe import MoE
from autopar.models.vocab import mask_padded_logits
from autopar.models.gpt import CausalSelfAttention, init_module_weights, init_transformer_weights


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class SwiGLU(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden, config.ffn_size, bias=False)
        self.up_proj = nn.Linear(config.hidden, config.ffn_size, bias=False)
        self.down_proj = nn.Linear(config.ffn_size, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = RMSNorm(config.hidden, config.norm_eps)
        self.mlp = MoE(config) if config.moe_experts else SwiGLU(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.padded_vocab, config.hidden)
        self.layers = nn.ModuleDict({str(i): LlamaBlock(config) for i in range(config.layers)})
        self.final_norm = RMSNorm(config.hidden, config.norm_eps)
        self.head = nn.Linear(config.hidden, config.padded_vocab, bias=False)
        if config.tied:
            self.head.weight = self.embed.weight
        cos, sin = rope_tables(config)
        # Derived from the config, so not saved in checkpoints.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.position_ids: torch.Tensor | None = None  # as GPT.position_ids: a sequence shard's positions
        init_transformer_weights(self, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids to logits; a pipeline stage (parts set to None) maps its input to its output."""
        if self.embed is not None:
            x = self.embed(x)
        rope = (self.rope_cos, self.rope_sin)
        if self.position_ids is not None:
            rope = (self.rope_cos[self.position_ids], self.rope_sin[self.position_ids])
        for layer in self.layers.values():
            x = layer(x, rope)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return mask_padded_logits(self.head(x), self.config.vocab) if self.head is not None else x

    def init_module_(self, path: str, module: nn.Module) -> None:
        """Initialize one module's own tensors (the rope tables for the root): see GPT.init_module_."""
        if path == "":
            module.rope_cos, module.rope_sin = rope_tables(self.config)
        else:
            init_module_weights(path, module, self.config)


def rope_tables(config: TransformerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim) for the rotate-half form."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(config.seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()
