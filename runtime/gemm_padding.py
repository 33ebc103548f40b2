"""Misaligned linear layers computed at an aligned width (`autopar.graph.paddable` says which, and
why the result is the model's own): the weight padded with zero rows, the output sliced back.

The class of each such module becomes `PaddedLinear`, a subclass of `nn.Linear` whose forward alone
differs: parameters, names, the state dict and checkpoints stay the model's. The cost model prices
the aligned products and the pad copies (`cost_models.compute.padding_copy_bytes`,
`backward_memory.padding_transient_bytes`) for the same layers and plans (`capabilities.gemm_padding_problem`).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from autopar.capabilities import gemm_padding_problem
from autopar.graph.paddable import paddable_linears


class PaddedLinear(nn.Linear):
    """`nn.Linear` whose product runs at `padded_width` output features, sliced back to its own."""

    padded_width: int

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 (nn.Linear's own argument name)
        extra = self.padded_width - self.out_features
        weight = F.pad(self.weight, (0, 0, 0, extra))
        bias = F.pad(self.bias, (0, extra)) if self.bias is not None else None
        return F.linear(input, weight, bias)[..., : self.out_features]


def apply_gemm_padding(model: nn.Module, strategy, precision: str) -> str:
    """Pad the model's misaligned linear layers where the plan allows it; returns what was done, in
    a few words (`autopar run` prints it)."""
    problem = gemm_padding_problem(strategy, precision)
    found = paddable_linears(model)
    if not found:
        return "none needed"
    if problem is not None:
        return f"not applied ({problem})"
    modules = dict(model.named_modules())
    for path, (_, width) in found.items():
        module = modules[path]
        module.__class__ = PaddedLinear
        module.padded_width = width
    return ", ".join(f"{path or 'model'} {out:,} -> {width:,} (outputs sliced back)"
                     for path, (out, width) in found.items())
