"""A mixture-of-experts MLP for the zoo's GPT and Llama (`moe_experts=E, moe_top_k=k`).

Router: a Linear to E logits, softmax in fp32, the top k experts per token, their probabilities
renormalized to sum to one (Mixtral's gate, Jiang et al. 2024, §2.1). Dispatch is dense and
deterministic, with fixed shapes: each sequence is one group (GShard, Lepikhin et al. 2020, §2.2)
whose tokens fill each expert's queue of C = `expert_capacity` slots, first choices before second
choices and earlier tokens first; a token past its expert's capacity skips that expert (the
residual carries it). The experts' input is one [E, batch·C, hidden] buffer, whatever the routing,
so expert parallelism (`runtime.expert_parallel`) sends fixed, predictable bytes, and because
groups are sequences, which tokens are dropped does not depend on how the batch is split over
ranks or micro-batches: the single-process forward is the reference every plan reproduces.
No capacity factor (the default): C = sequence length, nothing is ever dropped.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from autopar.graph.moe import expert_capacity


class Experts(nn.Module):
    """E expert MLPs as stacked weights, applied to [E, tokens, hidden] by batched matmuls:
    GELU (gpt) or SwiGLU (llama). Expert parallelism keeps a slice of the first dimension."""

    def __init__(self, experts: int, hidden: int, ffn: int, gated: bool, init_std: float, out_std: float) -> None:
        super().__init__()
        self.gated, self.init_std, self.out_std = gated, init_std, out_std
        self.w_in = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w_gate = nn.Parameter(torch.empty(experts, hidden, ffn)) if gated else None
        self.w_out = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = torch.bmm(x, self.w_in)
        inner = F.silu(torch.bmm(x, self.w_gate)) * up if self.gated else F.gelu(up, approximate="tanh")
        return torch.bmm(inner, self.w_out)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_in, std=self.init_std)
        if self.w_gate is not None:
            nn.init.normal_(self.w_gate, std=self.init_std)
        nn.init.normal_(self.w_out, std=self.out_std)


class MoE(nn.Module):
    """Top-k routed experts replacing a block's MLP (see the module docstring)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts = config.moe_experts
        self.top_k = config.moe_top_k
        self.capacity_factor = config.moe_capacity_factor
        self.router = nn.Linear(config.hidden, self.num_experts, bias=False)
        self.experts = Experts(self.num_experts, config.hidden, config.ffn_size, gated=config.family == "llama",
                               init_std=config.init_std, out_std=config.init_std / math.sqrt(2 * config.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        experts, k = self.num_experts, self.top_k
        capacity = expert_capacity(seq, experts, k, self.capacity_factor)
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, chosen = probs.topk(k, dim=-1)  # [batch, seq, k]
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        # choice-major order: every token's first choice queues before any second choice
        chosen = chosen.transpose(1, 2).reshape(batch, k * seq)
        slot = dispatch_slots(chosen, experts, capacity)  # [batch, k·seq], experts·capacity = dropped
        tokens = x.unsqueeze(1).expand(batch, k, seq, hidden).reshape(batch, k * seq, hidden)
        tokens = _autocast_dtype(tokens)  # the experts' precision, and so the all-to-all's
        rows = experts * capacity
        source = torch.full((batch, rows + 1), k * seq, dtype=torch.long, device=x.device)
        source = source.scatter(1, slot, torch.arange(k * seq, device=x.device).expand(batch, -1))
        padded = torch.cat((tokens, tokens.new_zeros(batch, 1, hidden)), dim=1)
        dispatched = padded.gather(1, source[:, :rows, None].expand(-1, -1, hidden))  # [batch, E·C, hidden]
        expert_in = dispatched.view(batch, experts, capacity, hidden).transpose(0, 1).reshape(
            experts, batch * capacity, hidden)
        expert_out = self.experts(expert_in)
        combined = expert_out.view(experts, batch, capacity, hidden).transpose(0, 1).reshape(batch, rows, hidden)
        combined = torch.cat((combined, combined.new_zeros(batch, 1, hidden)), dim=1)
        gathered = combined.gather(1, slot[..., None].expand(-1, -1, hidden))  # [batch, k·seq, hidden]
        mixed = gathered.view(batch, k, seq, hidden) * weights.transpose(1, 2)[..., None].to(gathered.dtype)
        return mixed.sum(1).to(x.dtype)


def _autocast_dtype(tensor: torch.Tensor) -> torch.Tensor:
    device = tensor.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return tensor.to(torch.get_autocast_dtype(device))
    return tensor


def dispatch_slots(chosen: torch.Tensor, experts: int, capacity: int) -> torch.Tensor:
    """Each (choice, token)'s slot in the [E·C] dispatch buffer, in queue order; E·C when its expert is full."""
    one_hot = (chosen[..., None] == torch.arange(experts, device=chosen.device)).long()  # [batch, n, E]
    position = ((one_hot.cumsum(1) - 1) * one_hot).sum(-1)  # place in its expert's queue
    return torch.where(position < capacity, chosen * capacity + position,
                       torch.full_like(chosen, experts * capacity))
