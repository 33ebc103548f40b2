"""The batches `autopar run` feeds a user's factory model: what its example input says, or its own.

A factory model states its training step through its module (see the README's "Your own model"):
`example_inputs(batch, seq_len, device)` gives one sample's input (one tensor: the runtime feeds
one), `loss(output, inputs)` the loss. Without a dataset, every rank draws the same global batch
from `--seed`: floats from N(0, 1), booleans as fair coins, integers uniformly from [0, vocab) where
the model states its vocabulary (a Hugging Face `config.vocab_size`, or a `vocab_size` attribute).
Two optional hooks replace that: `make_batch(batch, generator)` draws synthetic batches of the
model's own (say integers of another range), and `batches(global_batch, step)` hands real data,
the global batch of optimizer step `step` (1, 2, ...); it must be a pure function of the step, so a
resumed run gets the batches it would have got.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from autopar.errors import AutoparError

SYNTHETIC_INPUTS_STATE = "autopar-synthetic-inputs"
FACTORY_BATCHES_STATE = "autopar-factory-batches"
_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def sample_text(example: torch.Tensor) -> str:
    """`int64[16]`: one sample's dtype and shape, as the run's messages name an input."""
    return f"{str(example.dtype).removeprefix('torch.')}[{', '.join(str(n) for n in example.shape[1:])}]"


def factory_input(spec, seq_len: int | None) -> torch.Tensor:
    """The one tensor a factory model takes (batch 1, on meta), refused in one line where `autopar run`
    cannot train the model: no loss, several inputs, or an input synthetic data cannot draw."""
    if spec.loss_fn is None:
        raise AutoparError(f"factory {spec.name!r} built a model without a loss: give the module a "
                           f"loss(output, inputs) method returning the scalar to train (see the README's "
                           f"\"Your own model\")")
    inputs = spec.example_inputs(1, seq_len)
    if len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor):
        raise AutoparError(f"factory {spec.name!r}: its example_inputs gives {len(inputs)} inputs, autopar run "
                           f"feeds the model one tensor: wrap the model so that one tensor drives its forward")
    example = inputs[0]
    hooks = [name for name in ("make_batch", "batches") if callable(getattr(spec.module, name, None))]
    if not hooks:
        check_drawable(spec, example)
    return example


def check_drawable(spec, example: torch.Tensor) -> None:
    """Whether `SyntheticInputs` can draw batches like `example` (one line saying how to fix it if not)."""
    dtype = example.dtype
    if dtype.is_floating_point or dtype == torch.bool:
        return
    if dtype not in _INTEGERS:
        raise AutoparError(f"factory {spec.name!r} takes {sample_text(example)}: synthetic data cannot draw "
                           f"{dtype}; give the module a make_batch(batch, generator) or batches(global_batch, "
                           f"step) method")
    if spec.vocab is None:
        raise AutoparError(f"factory {spec.name!r} takes integers ({sample_text(example)}) but states no range "
                           f"for them: give the module a vocab_size attribute (ids drawn from [0, vocab_size)) or "
                           f"a make_batch(batch, generator) method")
    if spec.vocab < 1 or (dtype != torch.int64 and spec.vocab - 1 > torch.iinfo(dtype).max):
        raise AutoparError(f"factory {spec.name!r}: vocab_size {spec.vocab} does not fit its {dtype} input: fix "
                           f"the model's vocab_size")


class SyntheticInputs:
    """Global batches shaped like the model's example input, drawn from the seed identically on every
    rank (or by the model's own `make_batch(batch, generator)` from the same generator)."""

    whole_batch = True

    def __init__(self, spec, example: torch.Tensor, global_batch: int, seed: int) -> None:
        self.name, self.shape, self.dtype = spec.name, tuple(example.shape[1:]), example.dtype
        self.vocab, self.global_batch = spec.vocab, global_batch
        self.make_batch: Callable | None = getattr(spec.module, "make_batch", None)
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> torch.Tensor:
        rows, g = (self.global_batch, *self.shape), self.generator
        if self.make_batch is not None:
            return checked_batch(self, _call(self.name, "make_batch", self.make_batch, self.global_batch, g))
        if self.dtype.is_floating_point:
            return torch.randn(rows, generator=g).to(self.dtype)
        if self.dtype == torch.bool:
            return torch.randint(0, 2, rows, generator=g).bool()
        return torch.randint(0, self.vocab, rows, generator=g).to(self.dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"format": SYNTHETIC_INPUTS_STATE, "shape": list(self.shape), "dtype": str(self.dtype),
                "generator": self.generator.get_state().tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(state, SYNTHETIC_INPUTS_STATE, "--data synthetic")
        if (state.get("shape"), state.get("dtype")) != (list(self.shape), str(self.dtype)):
            raise AutoparError(f"the checkpoint's synthetic inputs are {state.get('dtype')}{state.get('shape')}, this "
                               f"model takes {self.dtype}{list(self.shape)}: use the same --model-config and "
                               f"--seq-len, or --resume none")
        self.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))

    def close(self) -> None:
        pass


class FactoryBatches:
    """The model's own data: `batches(global_batch, step)`, the global batch of step 1, 2, ...; its
    position is the step, so a checkpoint resumes it exactly."""

    whole_batch = True

    def __init__(self, spec, example: torch.Tensor, global_batch: int) -> None:
        self.name, self.shape, self.dtype = spec.name, tuple(example.shape[1:]), example.dtype
        self.global_batch, self.batches, self.step = global_batch, spec.module.batches, 0

    def next_batch(self) -> torch.Tensor:
        self.step += 1
        return checked_batch(self, _call(self.name, "batches", self.batches, self.global_batch, self.step))

    def state_dict(self) -> dict[str, Any]:
        return {"format": FACTORY_BATCHES_STATE, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(state, FACTORY_BATCHES_STATE, "the model's batches(global_batch, step)")
        self.step = int(state["step"])

    def close(self) -> None:
        pass


def checked_batch(source, batch: Any) -> torch.Tensor:
    """A hook's batch, refused in one line unless it has the global batch's rows and the example's dtype and shape."""
    want = f"{str(source.dtype).removeprefix('torch.')}[{', '.join(map(str, (source.global_batch, *source.shape)))}]"
    if not isinstance(batch, torch.Tensor):
        raise AutoparError(f"factory {source.name!r}: its batch hook returned {type(batch).__name__}, not a tensor "
                           f"({want}): return one tensor")
    if batch.dtype != source.dtype or tuple(batch.shape) != (source.global_batch, *source.shape):
        got = f"{str(batch.dtype).removeprefix('torch.')}[{', '.join(map(str, batch.shape))}]"
        raise AutoparError(f"factory {source.name!r}: its batch hook returned {got}, the global batch is {want} "
                           f"(the example input's dtype and shape): fix the hook")
    return batch


def _call(name: str, hook: str, function: Callable, *args: Any) -> Any:
    try:
        return function(*args)
    except AutoparError:
        raise
    except (Exception, SystemExit) as error:
        from autopar.models import factory_error

        raise factory_error(name, f"making a batch (its {hook} method)", error) from error


def _check_state(state: Any, expected: str, source: str) -> None:
    if not isinstance(state, dict) or state.get("format") != expected:
        raise AutoparError(f"the checkpoint was not trained on {source}: give the data it was trained on, or "
                           f"--resume none to start fresh")
