"""A shallow twin of a deep model: the same modules with its stack of repeated blocks cut short.

Planning asks the runtime questions whose answer is a property of the block, not of how many blocks
are stacked: can the forward be cut into pipeline stages, do the tensor-parallel module rules run and
send what they are priced to send. Asked of gpt3-175b's 96 blocks, each took as long as the trace
(6-15 s on this project's 2-core CI machine); asked of a twin with two or three blocks, a fraction of a
second. The twin shares the model's parameters and submodules (nothing is copied but the modules on
the path to the stack, shallowly), and the model itself is never modified.

An answer is taken from twins only when two twins of different depths agree on it (`same_at_depths`):
a forward that depends on how many blocks there are (per-layer hidden-state tuples, a schedule of
layer kinds) shows it by answering differently, and the caller then asks the whole model.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from torch import nn

TWIN_DEPTHS = (2, 3)  # the two depths asked; the whole model is asked when its stack is not deeper
MIN_BLOCKS_FOR_TWINS = 8  # below this the whole model is cheap to ask


def block_stack(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(path, container) of the model's stack of repeated blocks: the first nn.ModuleList,
    nn.ModuleDict or nn.Sequential (in module order) whose children all share one class and all own
    parameters, at least two of them; None when there is none."""
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) or len(module) < 2:
            continue
        children = list(module.children())
        if len({type(child) for child in children}) == 1 and all(_owns_parameters(c) for c in children):
            return path, module
    return None


def shallow_twin(model: nn.Module, depth: int) -> nn.Module | None:
    """`model` with its block stack cut to the first `depth` blocks, or None when it has no stack
    deeper than `depth`. Modules off the path to the stack are shared with `model`."""
    found = block_stack(model)
    if found is None or len(found[1]) <= depth:
        return None
    path, stack = found
    short = copy.copy(stack)  # its class and settings, the first `depth` children
    short._modules = dict(list(stack._modules.items())[:depth])
    return _with_child(model, path.split(".") if path else [], short)


def twin_of_blocks(model: nn.Module, path: str, blocks: list[int]) -> nn.Module:
    """`model` with its stack at `path` holding only the blocks at positions `blocks`, in that order,
    keyed 0, 1, ... (the capture's twin and probe, `autopar.graph.repeats`)."""
    stack = model.get_submodule(path)
    children = list(stack._modules.values())
    short = copy.copy(stack)
    short._modules = {str(i): children[block] for i, block in enumerate(blocks)}
    return _with_child(model, path.split(".") if path else [], short)


def twin_answer(model: nn.Module, ask: Callable[[nn.Module], Any],
                depths: tuple[int, ...] = TWIN_DEPTHS) -> Any:
    """`ask(model)`, asked of shallow twins when the model's stack has at least `MIN_BLOCKS_FOR_TWINS`
    blocks and every twin answers the same; of the whole model otherwise."""
    found = block_stack(model)
    if found is None or len(found[1]) < max(MIN_BLOCKS_FOR_TWINS, max(depths) + 1):
        return ask(model)
    answers = [ask(shallow_twin(model, depth)) for depth in depths]
    if all(answer == answers[0] for answer in answers[1:]):
        return answers[0]
    return ask(model)


def _with_child(module: nn.Module, path: list[str], replacement: nn.Module) -> nn.Module:
    """A shallow copy of `module` whose descendant at `path` is `replacement` (copies along the path)."""
    if not path:
        return replacement
    head, rest = path[0], path[1:]
    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    twin._modules[head] = _with_child(module._modules[head], rest, replacement)
    return twin


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())
