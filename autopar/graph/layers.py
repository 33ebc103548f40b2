"""Repeated-layer detection: structurally identical sibling blocks become one layer type.

Two siblings are the same type when their module trees match (classes, parameter and buffer
shapes) and the forward ops traced for them match (targets and shapes). Backward may differ slightly:
the first block computes no gradient for the model's input. The search
walks top-down and stops at the first level that repeats, so a GPT's 96 blocks form one type
rather than 96 × (attention, MLP) types.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

from torch import nn

from autopar.graph.ir import LayerType, OpNode


def detect_layer_types(model: nn.Module, nodes: list[OpNode]) -> list[LayerType]:
    structure = _structure_hashes(model)
    by_instance = _nodes_by_module_prefix(model, nodes)
    op_signature = {path: _op_hash(ops) for path, ops in by_instance.items()}
    layer_types: list[LayerType] = []
    pending = [("", model)]
    while pending:
        parent_path, parent = pending.pop(0)
        groups: dict[tuple[str, str], list[tuple[str, nn.Module]]] = defaultdict(list)
        for child_name, child in parent.named_children():
            path = f"{parent_path}.{child_name}" if parent_path else child_name
            groups[(structure[id(child)], op_signature.get(path, ""))].append((path, child))
        repeated = set()
        for members in groups.values():
            paths = [path for path, _ in members]
            ops = by_instance.get(paths[0], [])
            if len(members) < 2 or not any(op.flops for op in ops):
                continue
            repeated.update(paths)
            layer_types.append(_layer_type(f"L{len(layer_types)}", members, by_instance))
        for child_name, child in parent.named_children():
            path = f"{parent_path}.{child_name}" if parent_path else child_name
            if path not in repeated:
                pending.append((path, child))
    instance_type = {path: lt.id for lt in layer_types for path in lt.instances}
    for node in nodes:
        instance = _enclosing(node.module_path, instance_type)
        if instance is not None:
            node.layer, node.layer_type = instance, instance_type[instance]
    return layer_types


def _layer_type(type_id: str, members: list[tuple[str, nn.Module]], by_instance: dict) -> LayerType:
    first_path, first = members[0]
    ops = by_instance.get(first_path, [])
    return LayerType(
        id=type_id,
        class_name=type(first).__name__,
        instances=[path for path, _ in members],
        params_per_instance=sum(p.numel() for p in first.parameters()),
        nodes_per_instance=len(ops),
        forward_flops_per_instance=sum(op.flops for op in ops if op.phase == "forward"),
        backward_flops_per_instance=sum(op.flops for op in ops if op.phase == "backward"),
    )


def _enclosing(module_path: str, instances: dict[str, str]) -> str | None:
    path = module_path
    while path:
        if path in instances:
            return path
        path = path.rpartition(".")[0]
    return None


def _structure_hashes(model: nn.Module) -> dict[int, str]:
    hashes: dict[int, str] = {}

    def visit(module: nn.Module) -> str:
        if id(module) in hashes:
            return hashes[id(module)]
        parts = [type(module).__qualname__]
        parts += [f"p:{n}:{tuple(p.shape)}:{p.dtype}" for n, p in module.named_parameters(recurse=False)]
        parts += [f"b:{n}:{tuple(b.shape)}:{b.dtype}" for n, b in module.named_buffers(recurse=False)]
        parts += [f"c:{n}:{visit(c)}" for n, c in module.named_children()]
        digest = hashlib.sha1("|".join(parts).encode()).hexdigest()
        hashes[id(module)] = digest
        return digest

    visit(model)
    return hashes


def _nodes_by_module_prefix(model: nn.Module, nodes: list[OpNode]) -> dict[str, list[OpNode]]:
    """Every module path → the ops issued inside it (its own and its descendants')."""
    grouped: dict[str, list[OpNode]] = defaultdict(list)
    for node in nodes:
        path = node.module_path
        while path:
            grouped[path].append(node)
            path = path.rpartition(".")[0]
    return grouped


def _op_hash(ops: list[OpNode]) -> str:
    digest = hashlib.sha1()
    for op in ops:
        if op.phase != "forward":  # the first block skips its input gradient: same type all the same
            continue
        shapes = ",".join(str(m.shape) for m in op.output_meta)
        digest.update(f"{op.op}|{op.phase}|{shapes};".encode())
    return digest.hexdigest()
