"""The model's forward as one flat program over its own modules, for cutting pipeline stages.

`torch.export` (non-strict, on fake tensors: nothing is computed and no weight is read) captures
the forward at the micro-batch shape with the call signatures of the listed modules preserved.
The captured ATen graph is then rewritten so that each listed module is one `call_module` node
with the arguments the model passed it: the stage that runs the program calls the model's own
module objects (with their hooks, so tensor parallelism, recompute and FSDP apply to them as to
the whole model), and only the code between them (masks, position tables, residual glue) runs as
captured ATen ops. Parameters read outside listed modules are `get_attr` nodes under their own
names, so a program keeps the model's parameter names.

The forward is captured as training calls it: a model whose configuration asks it to build an
inference cache (Hugging Face's `use_cache`, on by default for every causal LM) is captured with the
cache off. The loss never reads the cache, and the cache objects it would hand each block are not
tensors a stage boundary can carry. `ModelProgram.training_settings` says what was turned off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from typing import Any, Iterator

import torch
from torch import fx, nn
from torch.export.graph_signature import ConstantArgument, InputKind, TensorArgument
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError


@dataclasses.dataclass
class ModelProgram:
    """One forward of the model as an fx graph over its listed modules (see the module docstring).

    Placeholders are the model's tensor inputs, named `input_0, input_1, ...` in the order of the
    flattened (args, kwargs); the output is the flat list of the forward's output leaves, which
    `out_spec` rebuilds into the model's own output type (a tensor, a tuple, a ModelOutput).
    """

    graph: fx.Graph
    attributes: dict[str, Any]  # get_attr targets that are not the model's own (captured sub-graphs)
    out_spec: pytree.TreeSpec
    input_names: list[str]  # placeholder names in order
    training_settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. {"use_cache": False}

    def output_paths(self) -> list[str]:
        """Each output leaf's place in the model's output, as the loss would name it ("logits", "[0]")."""
        output = next(node for node in self.graph.nodes if node.op == "output")
        numbered = pytree.tree_unflatten(list(range(len(output.args[0]))), self.out_spec)
        paths = {leaf: _path_text(path) for path, leaf in pytree.tree_flatten_with_path(numbered)[0]}
        return [paths.get(index, f"[{index}]") for index in range(len(output.args[0]))]


def _path_text(path: tuple) -> str:
    """A leaf's key path as Python reads it off the output: `hidden_states[0]`, `[1]`, `output`."""
    text = ""
    for key in path:
        if isinstance(key, pytree.SequenceKey):
            text += f"[{key.idx}]"
        elif isinstance(key, pytree.MappingKey):
            text += f".{key.key}" if isinstance(key.key, str) else f"[{key.key!r}]"
        elif isinstance(key, pytree.GetAttrKey):
            text += f".{key.name}"
        else:
            text += str(key)
    return text.lstrip(".") or "output"


# Configuration flags that make a forward build inference-only state; off for training.
_INFERENCE_ONLY_SETTINGS = {"use_cache": False}


@contextlib.contextmanager
def training_call(model: nn.Module) -> Iterator[dict[str, Any]]:
    """Within: every configuration the model's modules read (`module.config`, and its text
    sub-configuration) has its inference-only flags off. Yields the settings changed; restores them."""
    configs: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        for candidate in (config, _text_config(config)):
            if candidate is not None and not isinstance(candidate, (dict, nn.Module)):
                configs.setdefault(id(candidate), candidate)
    changed: dict[str, Any] = {}
    restore: list[tuple[Any, str, Any]] = []
    try:
        for config in configs.values():
            for name, value in _INFERENCE_ONLY_SETTINGS.items():
                current = getattr(config, name, value)
                if current is not None and current != value:
                    restore.append((config, name, current))
                    setattr(config, name, value)
                    changed[name] = value
        yield changed
    finally:
        for config, name, value in reversed(restore):
            setattr(config, name, value)


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    try:
        text = getter() if callable(getter) else None
    except Exception:  # a configuration without a text part raises on some versions
        return None
    return text if text is not config else None


def capture_program(model: nn.Module, args: tuple, kwargs: dict, module_paths: list[str],
                    optional: set[str] = frozenset()) -> ModelProgram:
    """Capture `model(*args, **kwargs)` with each module in `module_paths` kept as one call.

    A module in `optional` whose call the capture cannot keep (called twice, or not recorded) runs
    as captured code like the rest, its weights read by name.

    Raises AutoparError with the reason when the forward cannot be captured this way.
    """
    try:
        with training_call(model) as settings:
            exported = torch.export.export(model, tuple(args), dict(kwargs), strict=False,
                                           preserve_module_call_signature=tuple(module_paths))
    except Exception as error:  # any failure inside user code or torch: say what it was, in one line
        hint = ("; the forward asks for an inference cache itself (use_cache=True in its code): call the inner "
                "model without it for training") if "Cache" in str(error) else ""
        raise AutoparError(f"the forward cannot be captured for pipeline stages (torch.export: "
                           f"{_first_line(error)}){hint}") from error
    return dataclasses.replace(_outline(exported, module_paths, optional), training_settings=settings)


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _outline(exported, module_paths: list[str], optional: set[str]) -> ModelProgram:
    signature = exported.graph_signature
    calls_by_path = {entry.fqn: entry.signature for entry in exported.module_call_graph if entry.fqn in module_paths}
    module_paths = [p for p in module_paths if calls_by_path.get(p) is not None or p not in optional]
    missing = [p for p in module_paths if calls_by_path.get(p) is None]
    if missing:
        raise AutoparError(f"module {missing[0]!r} is not called by the forward (or called more than once), so no "
                           f"pipeline stage can own it")
    listed = set(module_paths)
    owner: dict[str, str] = {}  # old node name -> the listed module whose call contains it
    for node in exported.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        for path, _ in stack.values():
            if path in listed:
                owner[node.name] = path
                break

    graph = fx.Graph()
    env: dict[str, Any] = {}
    input_names, attributes = [], {}
    specs = {spec.arg.name: spec for spec in signature.input_specs}
    user_index = 0
    for node in exported.graph.nodes:
        if node.op != "placeholder":
            break
        spec = specs[node.name]
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            env[node.name] = graph.get_attr(spec.target)
        elif spec.kind == InputKind.CONSTANT_TENSOR:  # a tensor the forward makes from Python values
            name = f"_captured_constant_{len(attributes)}"
            attributes[name] = exported.constants[spec.target]
            env[node.name] = graph.get_attr(name)
        elif spec.kind == InputKind.USER_INPUT:
            name = f"input_{user_index}"
            user_index += 1
            env[node.name] = graph.placeholder(name)
            env[node.name].meta["val"] = node.meta.get("val")
            input_names.append(name)
        else:
            raise AutoparError(f"the forward reads a {spec.kind.name.lower()} ({spec.target}), which pipeline stages "
                               f"cannot carry")
    exported_nodes = {node.name: node for node in exported.graph.nodes}
    emitted: set[str] = set()
    outputs = []
    for node in exported.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            user_outputs = node.args[0][len(signature.buffers_to_mutate) + len(signature.user_inputs_to_mutate):]
            outputs = [_available(env, o, owner) if isinstance(o, fx.Node) else o for o in user_outputs]
            continue
        path = owner.get(node.name)
        if path is not None:
            if path not in emitted:
                emitted.add(path)
                _emit_call(graph, env, path, calls_by_path[path], exported_nodes)
            continue
        if node.op == "get_attr":  # a captured sub-graph (a no_grad or autocast region): kept by a name of ours
            attributes[f"_captured_{node.target}"] = getattr(exported.graph_module, node.target)
        for used in node.all_input_nodes:
            _available(env, used, owner)
        env[node.name] = graph.node_copy(node, lambda n: env[n.name])
        if node.op == "get_attr":
            env[node.name].target = f"_captured_{node.target}"
    graph.output(tuple(outputs))
    _refuse_state_mutation(graph)
    _drop_unused(graph)
    used = {node.target for node in graph.nodes if node.op == "get_attr"}
    attributes = {name: value for name, value in attributes.items() if name in used}
    unknown = [name for name, value in attributes.items() if isinstance(value, torch.Tensor) and value.is_meta]
    if unknown:
        raise AutoparError("the forward makes a tensor constant on the meta device outside the modules pipeline stages "
                           "call, whose value the stages cannot know: pass the model with real weights")
    return ModelProgram(graph=graph, attributes=attributes, out_spec=exported.call_spec.out_spec,
                        input_names=input_names)


def _available(env: dict[str, Any], used: fx.Node, owner: dict[str, str]) -> fx.Node:
    """The new graph's value for `used`, which code outside the listed modules reads."""
    if used.name not in env:
        same = _unchanged_source(used)  # `x.to(x.dtype)` inside a module returns x itself
        if same is None or same.name not in env:
            raise AutoparError(f"the forward reads {used.name} from inside module {owner.get(used.name)!r}, which that "
                               f"module does not return: no pipeline stage boundary can hold it")
        env[used.name] = env[same.name]
    return env[used.name]


_RETURNS_SELF = {"aten::to", "aten::alias", "aten::contiguous", "aten::type_as"}


def _unchanged_source(node: fx.Node) -> fx.Node | None:
    """The tensor a chain of conversions that change nothing (same dtype, device, shape and strides:
    eager returns the input itself) started from, or None."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
            and node.target._schema.name in _RETURNS_SELF and node.args and isinstance(node.args[0], fx.Node):
        before, after = node.args[0].meta.get("val"), node.meta.get("val")
        if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)) or (
                before.dtype, before.device, before.shape, before.stride()) != (
                after.dtype, after.device, after.shape, after.stride()):
            return None
        node = node.args[0]
        if node.op != "call_function" or getattr(getattr(node.target, "_schema", None), "name", "") not in _RETURNS_SELF:
            return node
    return None


def _emit_call(graph: fx.Graph, env: dict[str, Any], path: str, signature, exported_nodes: dict) -> fx.Node:
    """`path(*args, **kwargs)` as the model called it; its outputs replace the nodes it returned."""
    flat = []
    for argument in signature.inputs:
        if isinstance(argument, TensorArgument):
            if argument.name not in env:
                raise AutoparError(f"module {path!r} is called with a value made inside another listed module")
            flat.append(env[argument.name])
        elif isinstance(argument, ConstantArgument):
            flat.append(argument.value)
        else:
            raise AutoparError(f"module {path!r} takes a {type(argument).__name__}, which pipeline stages cannot pass")
    call_args, call_kwargs = pytree.tree_unflatten(flat, signature.in_spec)
    call = graph.call_module(path, tuple(call_args), dict(call_kwargs))
    leaves = signature.outputs
    if signature.out_spec.is_leaf() and len(leaves) == 1:
        if isinstance(leaves[0], TensorArgument):
            env[leaves[0].name] = call
            call.meta["val"] = exported_nodes[leaves[0].name].meta.get("val")
        return call
    flat_out = graph.call_function(_output_leaves, (call, str(signature.out_spec)))
    for index, argument in enumerate(leaves):
        if isinstance(argument, TensorArgument):
            env[argument.name] = graph.call_function(operator.getitem, (flat_out, index))
            env[argument.name].meta["val"] = exported_nodes[argument.name].meta.get("val")
    return call


def _refuse_state_mutation(graph: fx.Graph) -> None:
    """Code outside the called modules that writes into a buffer or an input (a step counter, running
    statistics kept by the model itself) would be dropped or repeated by stages that recompute it."""
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
            continue
        for argument, value in zip(target._schema.arguments, node.args):
            if argument.alias_info is None or not argument.alias_info.is_write or not isinstance(value, fx.Node):
                continue
            root = value
            while root.op == "call_function" and isinstance(root.target, torch._ops.OpOverload) and \
                    root.target._schema.arguments and root.target._schema.arguments[0].alias_info is not None:
                root = root.args[0]
            if root.op in ("get_attr", "placeholder"):
                what = root.target if root.op == "get_attr" else "an input"
                raise AutoparError(f"the forward writes into {what} outside the modules pipeline stages call "
                                   f"({target.name()}), which stages cannot replay")


def _drop_unused(graph: fx.Graph) -> None:
    """Remove ops whose results nothing reads (shape asserts, values only a module's own code used)."""
    for node in reversed(list(graph.nodes)):
        if node.users or node.op not in ("call_function", "get_attr"):
            continue
        if node.op == "call_function" and node.is_impure() and "assert" not in str(node.target):
            continue
        graph.erase_node(node)


def _output_leaves(output: Any, spec: str) -> list:
    """A module's output as the flat leaves the captured graph numbered (checked against its spec)."""
    leaves, found = pytree.tree_flatten(output)
    if str(found) != spec:
        raise AutoparError(f"a module returned {found}, not the structure captured ({spec}): its output depends on "
                           f"something other than its inputs' shapes")
    return leaves
