"""Mixture-of-experts layers as graph facts: which modules route tokens to experts, and how many.

A module is a MoE layer when it holds its experts under a child named `experts` and states its
expert count and `top_k` (integers, on itself, its experts or its router, the child with an
[experts, hidden] weight; a ModuleList of experts counts itself): the zoo's
`autopar.models.moe.MoE` does, and so do Hugging Face's Mixtral and Qwen-MoE sparse blocks. What a step sends per all-to-all follows from the capacity:
a layer with a capacity factor pads each expert's queue to `expert_capacity` slots per sequence
(GShard's groups, Lepikhin et al. 2020, §2.2: tokens past the capacity are dropped), so every
dispatch moves E × C rows of the hidden size per sequence whatever the routing; a dropless layer
(no capacity) moves top_k rows per token on average.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict
from torch import nn


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Slots per expert for a group of `tokens` (one sequence): ceil(factor × tokens × top_k / experts),
    at most `tokens` (a token picks an expert once); no factor: `tokens` (nothing is ever dropped)."""
    if capacity_factor is None:
        return tokens
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / experts)))


class MoELayer(BaseModel):
    """One MoE layer of the traced model."""

    model_config = ConfigDict(frozen=True)

    module_path: str
    class_name: str
    experts: int
    top_k: int
    capacity_factor: float | None  # None: dropless (HF) or padded to the sequence (the zoo's, no factor)
    hidden: int
    expert_params: list[str]  # parameter names under the layer's `experts`
    expert_param_elements: int
    # Rows of `hidden` one dispatch (or combine) all-to-all moves per sample: E × capacity when
    # padded, top_k × tokens (balanced) when dropless.
    dispatch_rows_per_sample: int
    # The zoo's MoE, whose fixed-capacity dispatch `runtime.expert_parallel` shards over ep ranks.
    autopar_dispatch: bool


def find_moe_layers(model: nn.Module, seq_len: int | None) -> list[MoELayer]:
    """The MoE layers of `model` (see the module docstring), for sequences of `seq_len` tokens."""
    layers = []
    for path, module in model.named_modules():
        inner = getattr(module, "experts", None)
        if not isinstance(inner, nn.Module):
            continue
        router = next((child for child in module.children() if child is not inner and _router_shape(child)), None)
        experts = _first_int(module, inner, router, name="num_experts")
        if experts is None and isinstance(inner, nn.ModuleList):
            experts = len(inner)
        top_k = _first_int(module, router, name="top_k")
        if experts is None or top_k is None:
            continue
        names = [f"{path}.experts.{name}" if path else f"experts.{name}" for name, _ in inner.named_parameters()]
        factor = getattr(module, "capacity_factor", None)
        tokens = seq_len or 1
        own = type(module).__module__ == "autopar.models.moe"
        rows = experts * expert_capacity(tokens, experts, top_k, factor) if (own or factor is not None) \
            else top_k * tokens
        layers.append(MoELayer(module_path=path, class_name=type(module).__name__, experts=experts, top_k=top_k,
                               capacity_factor=factor, hidden=_router_shape(router)[-1] if router else 0,
                               expert_params=names, expert_param_elements=sum(p.numel() for p in inner.parameters()),
                               dispatch_rows_per_sample=rows, autopar_dispatch=own))
    return layers


def _first_int(*modules: nn.Module | None, name: str) -> int | None:
    """The first of the modules' `name` attributes that is an integer (the block's, its experts', its router's)."""
    for module in modules:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _router_shape(module: nn.Module) -> tuple[int, ...] | None:
    """The [experts, hidden] weight of a router (a Linear, or Hugging Face's top-k router module)."""
    weight = getattr(module, "weight", None)
    return tuple(weight.shape) if isinstance(weight, nn.Parameter) and weight.dim() == 2 else None
