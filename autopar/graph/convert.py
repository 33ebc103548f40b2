"""The traced fx graph of one training step as OpNodes: each call's shapes, FLOPs and bytes, the
parameters it reads (through views), its module, its phase, and what the backward keeps alive."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from autopar.graph import flops as work
from autopar.graph.ir import OpNode, TensorMeta


def tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=tuple(int(s) for s in tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."))


def convert_nodes(graph: torch.fx.Graph, placeholder_names: list[str], module_for_seq) -> list[OpNode]:
    fx_nodes = list(graph.nodes)
    output = fx_nodes[-1]
    loss_node = output.args[0][0]
    names: dict[torch.fx.Node, str] = {}
    carried: dict[torch.fx.Node, frozenset[str]] = {}  # parameters an output aliases
    base: dict[torch.fx.Node, tuple[torch.fx.Node, int]] = {}  # storage owner of an output
    placeholders = [n for n in fx_nodes if n.op == "placeholder"]
    for node, label in zip(placeholders, placeholder_names):
        names[node] = label
        carried[node] = frozenset([label.removeprefix("param:")]) if label.startswith("param:") else frozenset()
        base[node] = (node, -1)
    for node in fx_nodes:  # tensors made while tracing (e.g. an empty KV cache) are kept as constants
        if node.op == "get_attr":
            names[node], carried[node], base[node] = f"const:{node.target}", frozenset(), (node, -1)

    records: dict[torch.fx.Node, OpNode] = {}
    phase = "forward"
    for node in fx_nodes:
        if node.op != "call_function":
            continue
        if node.target is _getitem:
            source, index = node.args[0], node.args[1]
            names[node] = names[source]
            carried[node] = carried[source]
            base[node] = (base[source][0], index) if base[source][0] is source else base[source]
            continue
        inputs = [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, torch.fx.Node)]
        tensor_inputs = [a for a in inputs if isinstance(a.meta.get("val"), torch.Tensor)]
        input_meta = [tensor_meta(a.meta["val"]) for a in tensor_inputs]
        outputs = [t for t in tree_flatten(node.meta.get("val"))[0] if isinstance(t, torch.Tensor)]
        output_meta = [tensor_meta(t) for t in outputs]
        view = work.is_view(node.target)
        names[node] = node.name
        carried[node] = frozenset().union(*(carried[a] for a in inputs)) if view and inputs else frozenset()
        base[node] = base[inputs[0]] if view and inputs else (node, 0 if len(outputs) <= 1 else -1)
        arg_vals = tree_map_nodes(node.args)
        kwarg_vals = tree_map_nodes(node.kwargs)
        custom = node.meta.get("custom") or {}
        records[node] = OpNode(
            name=node.name,
            op=work.op_name(node.target),
            phase=phase,
            inputs=list(dict.fromkeys(names[a] for a in inputs)),
            input_meta=input_meta,
            input_names=[names[a] for a in tensor_inputs],
            output_meta=output_meta,
            flops=0 if view else work.tensor_flops(node.target, arg_vals, kwarg_vals, node.meta.get("val")),
            vector_flops=0 if view else work.vector_flops(
                node.target, [m.numel for m in input_meta], [m.numel for m in output_meta]
            ),
            bytes_read=0 if view else sum(m.bytes for m in input_meta),
            bytes_written=0 if view else sum(m.bytes for m in output_meta),
            is_view=view,
            params=sorted(frozenset().union(*(carried[a] for a in inputs))) if inputs else [],
            module_path=custom.get("module", ""),
        )
        if node is loss_node or (isinstance(loss_node, torch.fx.Node) and loss_node.target is _getitem
                                  and node is loss_node.args[0]):
            phase = "backward"
    _mark_saved(records, base)
    return list(records.values())


_getitem = __import__("operator").getitem


def tree_map_nodes(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return value.meta.get("val")
    if isinstance(value, (list, tuple)):
        return type(value)(tree_map_nodes(v) for v in value)
    if isinstance(value, dict):
        return {k: tree_map_nodes(v) for k, v in value.items()}
    return value


def _mark_saved(records: dict[torch.fx.Node, OpNode], base: dict) -> None:
    """A forward output read by a backward op stays alive across the step: count its bytes once."""
    saved: set[tuple[torch.fx.Node, int]] = set()
    for node, record in records.items():
        if record.phase != "backward":
            continue
        for arg in tree_flatten((node.args, node.kwargs))[0]:
            if not isinstance(arg, torch.fx.Node) or arg not in base:
                continue
            owner, index = base[arg]
            owner_record = records.get(owner)
            if owner_record is not None and owner_record.phase == "forward":
                saved.add((owner, index))
    for owner, index in saved:
        record = records[owner]
        if index == -1:
            record.saved_bytes = sum(m.bytes for m in record.output_meta)
        elif index < len(record.output_meta):
            record.saved_bytes += record.output_meta[index].bytes
