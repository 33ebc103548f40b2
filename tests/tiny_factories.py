"""User-style model factories for tests (imported as `tiny_factories:NAME`)."""

import torch
from torch import nn


class TinyMLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)

    def example_inputs(self, batch: int, seq_len: int, device="meta"):
        return (torch.empty(batch, self.width, device=device),)


def mlp(width: int = 32, depth: int = 3) -> TinyMLP:
    return TinyMLP(width, depth)


def not_a_module(**kwargs):
    return 42
