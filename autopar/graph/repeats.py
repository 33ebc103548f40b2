"""Capture a deep stack of identical blocks from a shallow twin of the model, expanded to its depth.

Tracing costs about a millisecond per ATen op, so gpt3-175b's 96 blocks (11k ops) take seconds
that the graph does not need: every middle block traces to the same ops. When the model holds one
stack of at least `MIN_BLOCKS` structurally identical blocks (a ModuleList, ModuleDict or
Sequential keyed 0..N-1), we trace a *twin*: shallow copies of the modules down to the stack, the
stack holding blocks 0, 1 and N-1 only (the user's modules are shared, never changed). Its graph
is expanded to N blocks by repeating block 1's (`TEMPLATE`) forward and backward ops: fresh node
names as fx names them in the full trace's order, module paths and parameter names moved to each
copy's block, inputs rewired to the neighbouring copy's producers.

A wrong graph would misprice every plan, so the shortcut is taken only where it is checked on
this model: blocks that hold different state (other than a layer index: position plus a constant),
a config list with one varying entry per layer (`layer_types`), blocks shared or reachable
elsewhere, and stacks whose ops interleave take the full trace; and a probe twin of blocks 0, N/2,
N-2 and N-1 must trace to exactly the twin's graph expanded to 4 blocks, every field of every node
and of the graph (`expanded_step`). What no probe can see is a position test that the sampled blocks
do not hit (`if self.layer_idx == 57`, or a parent loop treating its i-th block specially without a
config list); `trace(..., expand_repeats=False)` traces every block.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from typing import Any, Callable

import torch
from torch import nn
from torch.fx.graph import Graph, _Namespace

from autopar.graph.ir import OpNode
from autopar.graph.layers import _structure_hashes
from autopar.graph.twin import twin_of_blocks

MIN_BLOCKS = 8  # below this the full trace is cheap: not worth any risk
TWIN_DEPTH = 3  # first block, template, last block: the template has a block on either side
TEMPLATE = 1
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_MODULE_INTERNALS = {"training", "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}


class NotExpandable(Exception):
    """Why a twin's graph cannot be expanded: the full trace is taken instead."""


@dataclasses.dataclass(frozen=True)
class TracedTwin:
    """The checked twin's traced step: `step` holds blocks 0, 1 and N-1 of the `depth` blocks at `path`;
    `full` is it expanded to all `depth`, the model's step."""

    path: str
    depth: int
    step: Any
    full: Any

    def at_depth(self, depth: int) -> Any:
        """The step with the stack's blocks expanded (or cut) to `depth`: 2 (blocks 0 and N-1's ops) or more."""
        return _expanded(self.step, self.path, depth)


def expanded_step(model: nn.Module, trace_step: Callable[[nn.Module], Any],
                  graph_of: Callable[[nn.Module, Any], Any]) -> tuple[Any | None, str]:
    """The traced step of `model` from its twin, or (None, why not): see `traced_twin`."""
    twin, reason = traced_twin(model, trace_step, graph_of)
    return (twin.full, "") if twin is not None else (None, reason)


def traced_twin(model: nn.Module, trace_step: Callable[[nn.Module], Any],
                graph_of: Callable[[nn.Module, Any], Any]) -> tuple[TracedTwin | None, str]:
    """The traced twin whose expansion is the traced step of `model`, or (None, why not).
    `trace_step(module)` traces a module's step (a `capture.StepTrace`), `graph_of(module, step)`
    makes its OpGraph.

    The twin holds blocks 0, 1 and N-1 (the last, with its own state, stays last); the check
    traces blocks 0, N/2, N-2 and N-1, so that blocks from across the stack (holding other layer
    indices) must trace as the twin's middle block expanded does."""
    stack = find_block_stack(model)
    if isinstance(stack, str):
        return None, stack
    path, depth = stack
    try:
        twin = twin_of_blocks(model, path, [0, TEMPLATE, depth - 1])
        probe = twin_of_blocks(model, path, [0, depth // 2, depth - 2, depth - 1])
        twin_step, probe_step = trace_step(twin), trace_step(probe)
        if graph_of(probe, _expanded(twin_step, path, 4)) != graph_of(probe, probe_step):
            return None, "the twin expanded to 4 blocks differs from blocks 0, N/2, N-2, N-1 traced"
        return TracedTwin(path, depth, twin_step, _expanded(twin_step, path, depth)), ""
    except NotExpandable as error:
        return None, str(error)
    except Exception as error:  # the twin may fail where the model would not (indexing past its blocks)
        return None, f"the twin's trace failed: {type(error).__name__}: {error}"


def _expanded(step: Any, path: str, depth: int) -> Any:
    """A copy of `step` with its stack's blocks expanded to `depth`."""
    return dataclasses.replace(step, nodes=expand_nodes(step.nodes, path, TWIN_DEPTH, depth),
                               attention_calls=expand_calls(step.attention_calls, path, TWIN_DEPTH, depth))


# --- which stack, and whether its blocks are interchangeable -------------------------------------
def find_block_stack(model: nn.Module) -> tuple[str, int] | str:
    """(path, depth) of the model's one deep stack of identical, independent blocks, or why none."""
    structure = _structure_hashes(model)
    stacks = []
    for path, module in model.named_modules():
        children = list(module.named_children())
        if (path and isinstance(module, _CONTAINERS) and len(children) >= MIN_BLOCKS
                and [key for key, _ in children] == [str(i) for i in range(len(children))]
                and len({structure[id(child)] for _, child in children}) == 1
                and not any(path.startswith(f"{outer}.") for outer, _ in stacks)):  # outermost stacks only
            stacks.append((path, module))
    if len(stacks) != 1:
        return f"{len(stacks)} stacks of at least {MIN_BLOCKS} identical blocks (the shortcut expands exactly one)"
    path, container = stacks[0]
    blocks = list(container.children())
    reason = _shared_state(model, blocks) or _differing_state(blocks) or _per_layer_config(model, len(blocks))
    return f"{path}: {reason}" if reason else (path, len(blocks))


def _shared_state(model: nn.Module, blocks: list[nn.Module]) -> str | None:
    """A block whose modules or parameters are reachable elsewhere is not independent."""
    modules = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    params = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for block in blocks:
        if any(modules[id(m)] != 1 for _, m in block.named_modules(remove_duplicate=False)):
            return "a block's module is shared"
        if any(params[id(p)] != 1 for _, p in block.named_parameters(remove_duplicate=False)):
            return "a block's parameter is shared"
    return None


def _differing_state(blocks: list[nn.Module]) -> str | None:
    """Blocks must hold the same state, but for integers that are their position plus a constant
    (a layer index): a stored flag, string or other number (sliding vs full attention, a window) may
    change what a block computes."""
    states = [_state(block) for block in blocks]
    if any(state.keys() != states[0].keys() for state in states):
        return "blocks hold different attributes"
    for key, first in states[0].items():
        values = [state[key] for state in states]
        if all(type(value) is int for value in values):
            if values != [first] * len(values) and values != [first + i for i in range(len(values))]:
                return f"{key} is {values[:4]}... by block: neither constant nor the layer index"
        elif not all(_same(value, first) for value in values[1:]):
            return f"blocks differ in {key}"
    return None


def _state(block: nn.Module) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for path, module in block.named_modules():
        for key, value in vars(module).items():
            if key not in _MODULE_INTERNALS:
                state[f"{path}:{key}"] = value
        state[f"{path}:training"] = module.training
        state[f"{path}:grad"] = tuple(p.requires_grad for p in module.parameters(recurse=False))
    return state


def _same(value: Any, other: Any) -> bool:
    if value is other:
        return True
    if type(value) is not type(other):
        return False
    if isinstance(value, (list, tuple)):
        return len(value) == len(other) and all(_same(a, b) for a, b in zip(value, other))
    if isinstance(value, dict):  # hooks, settings: the same keys and values
        return list(value) == list(other) and all(_same(value[k], other[k]) for k in value)
    if isinstance(value, functools.partial):  # an activation's own partial (HF's GELUTanh)
        return value.func is other.func and _same(value.args, other.args) and _same(value.keywords, other.keywords)
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device) == (other.shape, other.dtype, other.device)
    if getattr(value, "__func__", None) is not None:  # each block's bound method of the same function
        return other.__func__ is value.__func__
    if isinstance(value, (str, float, bool, frozenset, torch.dtype, type(None))):
        return value == other
    return False


def _per_layer_config(model: nn.Module, depth: int) -> str | None:
    """A config list with one entry per layer (`layer_types`) that varies: the parent may pick a
    block's mask or rope by index, which the blocks' own state does not show."""
    for module in model.modules():
        config = getattr(module, "config", None)
        for key, value in (vars(config).items() if hasattr(config, "__dict__") else ()):
            if isinstance(value, (list, tuple)) and len(value) == depth and len({repr(v) for v in value}) > 1:
                return f"config.{key} varies by layer"
    return None


# --- expansion ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Blocks:
    """Which twin block each of the full stack's `depth` blocks copies (the twin has `twin_depth`)."""

    path: str
    twin_depth: int
    depth: int

    def source(self, block: int) -> int:
        """The twin block whose ops full block `block` repeats."""
        last = self.depth - (self.twin_depth - TEMPLATE)
        return block if block < TEMPLATE else TEMPLATE if block <= last else block - (self.depth - self.twin_depth)

    def full_block(self, twin_block: int, at: int | None) -> int:
        """The full block that twin block `twin_block` stands for, seen from full block `at` (None:
        from outside the stack)."""
        if at is not None:
            return at + twin_block - self.source(at)
        if twin_block == TEMPLATE:
            raise NotExpandable("an op outside the stack reads the repeated block")
        return twin_block if twin_block < TEMPLATE else twin_block + self.depth - self.twin_depth

    def mover(self, name: str, reader: int | None) -> Callable[[int | None], str]:
        """`name` (a module path, or a parameter or buffer label) as an op of twin block `reader` (None:
        outside the stack) names it in full block `at`: a function of `at`."""
        kind, colon, rest = name.partition(":") if name.startswith(("param:", "buffer:")) else ("", "", name)
        j = block_index(rest, self.path)
        if j is None:
            return lambda at: name
        head, tail = f"{kind}{colon}{self.path}.", rest[len(self.path) + 1 + len(str(j)):]
        if reader is None:
            fixed = f"{head}{self.full_block(j, None)}{tail}"
            return lambda at: fixed
        shift = j - reader
        return lambda at: f"{head}{at + shift}{tail}"


class _Layout:
    """Where a twin's blocks sit in its node list: one contiguous run per block and phase, forward
    runs in block order and backward runs in reverse, with nothing between them."""

    def __init__(self, nodes: list[OpNode], blocks: _Blocks) -> None:
        self.blocks = blocks
        block = [block_index(node.module_path, blocks.path) for node in nodes]
        self.spans: dict[tuple[str, int], range] = {}
        for phase in ("forward", "backward"):
            for j in range(blocks.twin_depth):
                where = [i for i, (node, b) in enumerate(zip(nodes, block)) if b == j and node.phase == phase]
                if not where or where[-1] - where[0] + 1 != len(where):
                    raise NotExpandable(f"block {j}'s {phase} ops are not one contiguous run")
                self.spans[phase, j] = range(where[0], where[-1] + 1)
        for j in range(blocks.twin_depth - 1):
            if self.spans["forward", j].stop != self.spans["forward", j + 1].start:
                raise NotExpandable(f"ops run between blocks {j} and {j + 1}")
            if self.spans["backward", j + 1].stop != self.spans["backward", j].start:
                raise NotExpandable(f"ops run between the backward of blocks {j + 1} and {j}")
        ops = {key: [nodes[i].op for i in span] for key, span in self.spans.items()}
        self.alike = {(phase, a, b): ops[phase, a] == ops[phase, b]
                      for phase, a in ops for b in range(blocks.twin_depth)}
        self.position = {i: (phase, j, i - span.start) for (phase, j), span in self.spans.items() for i in span}
        self.sources = [blocks.source(block) for block in range(blocks.depth)]

    def order(self, count: int) -> list[tuple[int, int | None]]:
        """(twin node, full block or None) in the full trace's order: forward blocks, then backward reversed."""
        blocks, last = self.blocks, self.blocks.twin_depth - 1
        order: list[tuple[int, int | None]] = [(i, None) for i in range(self.spans["forward", 0].start)]
        for block in range(blocks.depth):
            order += [(i, block) for i in self.spans["forward", blocks.source(block)]]
        order += [(i, None) for i in range(self.spans["forward", last].stop, self.spans["backward", last].start)]
        for block in reversed(range(blocks.depth)):
            order += [(i, block) for i in self.spans["backward", blocks.source(block)]]
        return order + [(i, None) for i in range(self.spans["backward", 0].stop, count)]

    def reader(self, k: int, i: int, names: dict) -> Callable[[int | None], str]:
        """The full name of twin node `k` as twin node `i` reads it, as a function of the reader's full block."""
        if k not in self.position:
            return lambda at: names[k, None]
        phase, j, offset = self.position[k]
        if i not in self.position:  # read from outside the stack: the one block twin block j stands for
            target = self.blocks.full_block(j, None)
            return lambda at: names[k, target]
        shift, depth, sources = j - self.position[i][1], self.blocks.depth, self.sources
        starts = {s: self.spans[phase, s].start + offset for s in range(self.blocks.twin_depth)
                  if s == j or self.alike[phase, s, j]}

        def read(at: int) -> str:
            target = at + shift
            start = starts.get(sources[target]) if 0 <= target < depth else None
            if start is None:
                raise NotExpandable(f"block {at} reads block {target} as twin block {j} ({phase}), whose ops differ "
                                    f"from the block standing for it (a value shared by every block?)")
            return names[start, target]

        return read


def block_index(module_path: str, path: str) -> int | None:
    """The block of the stack at `path` that `module_path` lies in, or None."""
    if not module_path.startswith(f"{path}."):
        return None
    key = module_path[len(path) + 1:].partition(".")[0]
    return int(key) if key.isdigit() else None


def expand_nodes(nodes: list[OpNode], path: str, twin_depth: int, depth: int) -> list[OpNode]:
    """The nodes of the twin's graph (`twin_depth` blocks of the stack at `path`) for `depth` blocks."""
    blocks = _Blocks(path, twin_depth, depth)
    layout = _Layout(nodes, blocks)
    order = layout.order(len(nodes))
    namespace, graph = _Namespace(), Graph()
    bases = [_name_base(node, graph) for node in nodes]
    names = {(i, block): namespace.create_name(bases[i], None) for i, block in order}
    recipes = _recipes(nodes, layout, names)
    expanded = []
    for i, block in order:
        inputs, input_names, params, module_path = recipes[i]
        expanded.append(nodes[i].model_copy(update={
            "name": names[i, block],
            "inputs": [read(block) for read in inputs],
            "input_names": [read(block) for read in input_names],
            "input_meta": list(nodes[i].input_meta),
            "output_meta": list(nodes[i].output_meta),
            "params": sorted(move(block) for move in params) if params else [],
            "module_path": module_path(block),
            "layer": None, "layer_type": None,
        }))
    return expanded


def _recipes(nodes: list[OpNode], layout: _Layout, names: dict) -> list[tuple]:
    """Per twin node, functions of the full block that give its inputs, input names, parameters and
    module path there (worked out once per twin node, applied to each copy)."""
    index = {node.name: i for i, node in enumerate(nodes)}
    constants = _Constants(nodes, layout)
    recipes = []
    for i, node in enumerate(nodes):
        reader = layout.position[i][1] if i in layout.position else None
        readers: dict[str, Callable[[int | None], str]] = {}
        for name in dict.fromkeys(node.inputs + node.input_names):
            if name.startswith("const:"):
                readers[name] = functools.partial(constants.name, name)
            elif name in index:
                readers[name] = layout.reader(index[name], i, names)
            else:  # a parameter, buffer or input
                readers[name] = layout.blocks.mover(name, reader)
        recipes.append(([readers[n] for n in node.inputs], [readers[n] for n in node.input_names],
                        [layout.blocks.mover(n, reader) for n in node.params],
                        layout.blocks.mover(node.module_path, reader)))
    return recipes


def _name_base(node: OpNode, graph: Graph) -> str:
    """What make_fx asks fx to name a node after: the op's overload packet (aten.mm.default → mm)."""
    parts = node.op.split(".")
    return graph._target_to_str(parts[1] if len(parts) == 3 else node.name)


class _Constants:
    """Tensors made while tracing (graph constants): one made inside a block is made again by each
    copy; make_fx numbers them in order of first use, which `name` follows as it is asked."""

    def __init__(self, nodes: list[OpNode], layout: _Layout) -> None:
        readers: dict[str, set] = {}
        for i, node in enumerate(nodes):
            for name in node.inputs:
                if name.startswith("const:"):
                    readers.setdefault(name, set()).add(layout.position.get(i, (None, None))[1])
        self.home = {name: next(iter(blocks)) for name, blocks in readers.items() if len(blocks) == 1}
        self.layout, self.names = layout, {}

    def name(self, name: str, at: int | None) -> str:
        home = self.home.get(name)
        key = (name, self.layout.blocks.full_block(home, at) if home is not None else None)
        if key not in self.names:
            self.names[key] = f"const:_tensor_constant{len(self.names)}"
        return self.names[key]


def expand_calls(calls: list, path: str, twin_depth: int, depth: int) -> list:
    """The twin's attention calls for `depth` blocks: each block's calls repeated as its nodes are."""
    blocks = _Blocks(path, twin_depth, depth)
    owner = [block_index(call.module_path, path) for call in calls]
    inside = [i for i, j in enumerate(owner) if j is not None]
    if not inside:
        return list(calls)
    if inside[-1] - inside[0] + 1 != len(inside) or [owner[i] for i in inside] != sorted(owner[i] for i in inside):
        raise NotExpandable("the blocks' attention calls are not in block order")
    per_block = {j: [calls[i] for i in inside if owner[i] == j] for j in range(twin_depth)}
    expanded = list(calls[: inside[0]])
    for block in range(depth):
        source = blocks.source(block)
        expanded += [call.model_copy(update={"module_path": blocks.mover(call.module_path, source)(block)})
                     for call in per_block[source]]
    return expanded + list(calls[inside[-1] + 1:])
