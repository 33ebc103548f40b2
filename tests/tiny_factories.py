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


class Regressor(nn.Module):
    """A plain-torch model with float inputs and no tokens: residual MLP blocks regress each sample
    onto a fixed nonlinear function of itself (a target the input determines, as `loss` needs)."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.width = width
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def example_inputs(self, batch: int, seq_len: int, device="meta"):
        return (torch.empty(batch, self.width, device=device),)

    def loss(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, torch.sin(2 * x).roll(1, dims=-1))


def regressor(width: int = 16, depth: int = 4) -> Regressor:
    return Regressor(width, depth)


class RegressorWithBatches(Regressor):
    """The same model with its own data: batch `step` is a pure function of the step."""

    def batches(self, global_batch: int, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1000 + step)
        return torch.randn(global_batch, self.width, generator=generator)


def regressor_with_batches(width: int = 16, depth: int = 4, wrong_shape: bool = False):
    model = RegressorWithBatches(width, depth)
    if wrong_shape:
        model.batches = lambda global_batch, step: torch.zeros(global_batch, width + 1)
    return model


class _Inputs(nn.Module):
    """A model whose example input is `dtype` [batch, 8], with a loss; `vocab_size` when given."""

    def __init__(self, dtype: torch.dtype, count: int = 1, vocab_size=None) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.dtype, self.count = dtype, count
        if vocab_size is not None:
            self.vocab_size = vocab_size

    def forward(self, x, *rest):
        return self.proj(x.real.float() if x.is_complex() else x.float())

    def example_inputs(self, batch: int, seq_len: int, device="meta"):
        return tuple(torch.empty(batch, 8, dtype=self.dtype, device=device) for _ in range(self.count))

    def loss(self, output, *inputs):
        return output.pow(2).mean()


def complex_input():
    return _Inputs(torch.complex64)


def ids_without_range():
    return _Inputs(torch.int64)


def two_inputs():
    return _Inputs(torch.float32, count=2)


class _NoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)

    def loss(self, output, x):
        return output.pow(2).mean()


def no_example_inputs():
    return _NoInputs()
