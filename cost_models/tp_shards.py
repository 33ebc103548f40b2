"""Tensor-parallel shards propagated through the op graph, Megatron-style, from the graph alone.

Every 2-D parameter read by a matmul or an embedding is sharded over tp (`sharded_params`), or a
plan's placements say which are; sharding then propagates along data flow. An op with one sharded
operand of a contraction yields a sharded result (column parallel); two sharded operands contract
over the sharded dimension and yield partial sums (row parallel); partial sums flow through linear
ops (add, scale, views) and are all-reduced where a non-linear op first needs the full value. So the
all-reduces that a row-parallel linear, a vocab-parallel embedding, or the backward of a
column-parallel linear need fall out of the graph; `facts.model_facts` reads them per op.
"""

from __future__ import annotations

from autopar.graph.ir import OpGraph, OpNode

CONTRACTIONS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2), "convolution": (0, 1)}
_LINEAR = {"add", "sub", "mul", "div", "neg", "sum", "mean", "clone", "_to_copy", "copy", "cat", "expand", "view"}
_ATTENTION_MARKERS = ("scaled_dot_product", "flash_attention", "efficient_attention")


def column_biases(graph: OpGraph, tp_dims: dict[str, int]) -> set[str]:
    """Biases of column-parallel weights: split with the output features (the runtime shards them)."""
    return {p.name for p in graph.params if len(p.shape) == 1 and p.name.endswith(".bias")
            and tp_dims.get(p.name.removesuffix(".bias") + ".weight") == 0}


def op_packet(node: OpNode) -> str:
    """An ATen op's name without its namespace and overload ("aten.mm.default" -> "mm")."""
    parts = node.op.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else node.op


def is_attention(node: OpNode) -> bool:
    """Whether `node` is an attention op (scaled dot-product, flash or memory-efficient)."""
    return any(marker in node.op for marker in _ATTENTION_MARKERS)


def sharded_params(graph: OpGraph, params: dict) -> set[str]:
    """Megatron's choice of tp-sharded matrices: every 2-D parameter a contraction or an embedding reads."""
    sharded: set[str] = set()
    for node in graph.nodes:
        packet = op_packet(node)
        if packet in CONTRACTIONS or packet == "embedding":
            sharded.update(p for p in node.params if len(params[p].shape) == 2)
    return sharded


def propagate_shards(graph: OpGraph, sharded: set[str], unit_of: dict[str, str] | None = None
                     ) -> dict[str, tuple[str, float]]:
    """Per node: (status of its output: R, S or P; bytes per batch all-reduced before it runs).

    With `unit_of`, partial sums do not leave their unit: one that a node of another unit would
    reduce is charged to the op that produced it. The runtime reduces a block's input gradient as
    it leaves the block; without this, LLaMA's RMSNorm backward (elementwise, linear in the
    gradient) would carry it into the previous layer, on another pipeline rank.
    """
    unit_of = unit_of or {}
    carried: dict[str, float] = {}  # producer node -> bytes reduced on leaving its unit
    status: dict[str, str] = {}
    for p in graph.params:
        status[f"param:{p.name}"] = "S" if p.name in sharded else "R"
    result: dict[str, tuple[str, float]] = {}
    reduced: set[str] = set()
    root: dict[str, str] = {}  # a view -> the tensor it views
    layer_of = {node.name: node.layer for node in graph.nodes}
    holds: dict[str, bool] = {}

    def holds_shards(module: str) -> bool:
        """Whether `module` owns (directly or below) a sharded parameter."""
        if module not in holds:
            holds[module] = any(p == module or p.startswith(module + ".") for p in sharded)
        return holds[module]

    def get(name: str) -> str:
        return status.get(name, "R")

    for node in graph.nodes:
        names = node.input_names if node.input_names else node.inputs
        arg_status = [get(n) for n in names]
        reduce_bytes = 0.0

        def reduce_inputs(which: list[int]) -> None:
            nonlocal reduce_bytes
            for i in which:
                if i < len(names) and arg_status[i] == "P":
                    key = root.get(names[i], names[i])  # views of one partial sum share one reduction
                    if key not in reduced and i < len(node.input_meta):
                        if unit_of.get(key, unit_of.get(node.name)) != unit_of.get(node.name):
                            carried[key] = carried.get(key, 0.0) + node.input_meta[i].bytes
                        else:
                            reduce_bytes += node.input_meta[i].bytes
                        reduced.add(key)
                    arg_status[i] = "R"

        packet = op_packet(node)
        if not node.is_view and "P" in arg_status and _leaves_block(node, names, layer_of, holds_shards):
            reduce_inputs(list(range(len(arg_status))))
        if node.is_view:
            out = arg_status[0] if arg_status else "R"
            if names:
                root[node.name] = root.get(names[0], names[0])
        elif packet in CONTRACTIONS and len(arg_status) >= max(CONTRACTIONS[packet]) + 1:
            a, b = CONTRACTIONS[packet]
            pair = (arg_status[a], arg_status[b])
            if pair.count("S") == 2:
                # mm: both operands sharded along the contracted dimension (row parallel) → partial
                # sums. bmm: attention's batched products are sharded along heads, the batch
                # dimension, so the result stays sharded.
                out = "S" if packet in ("bmm", "baddbmm") else "P"
            elif "S" in pair:
                reduce_inputs([a, b])
                out = "S"
            elif "P" in pair:
                out = "P" if pair.count("P") == 1 else (reduce_inputs([a, b]) or "R")
            else:
                out = "R"
        elif packet == "embedding":
            # A vocabulary-parallel lookup leaves partial rows; the runtime reduces each lookup's
            # output right away (not once for a sum of lookups), so the reduction is charged here.
            out = "R"
            if arg_status and arg_status[0] == "S" and node.output_meta:
                reduce_bytes += node.output_meta[0].bytes
        elif packet == "embedding_dense_backward":
            reduce_inputs(list(range(len(arg_status))))  # each vocabulary shard needs the whole gradient
            out = "S" if sharded else "R"
        elif is_attention(node):
            reduce_inputs(list(range(len(arg_status))))
            out = "S" if "S" in arg_status else "R"
        elif packet in _LINEAR and "P" in arg_status:
            if packet in ("add", "sub") and any(s == "R" for s in arg_status):
                reduce_inputs(list(range(len(arg_status))))
                out = "S" if "S" in arg_status else "R"
            elif packet in ("mul", "div") and arg_status.count("P") > 1:
                reduce_inputs(list(range(len(arg_status))))
                out = "S" if "S" in arg_status else "R"
            else:
                out = "P"
        else:
            reduce_inputs(list(range(len(arg_status))))
            out = "S" if "S" in arg_status else "R"
        status[node.name] = out
        result[node.name] = (out, reduce_bytes)
    for name, nbytes in carried.items():
        out, reduce_bytes = result[name]
        result[name] = (out, reduce_bytes + nbytes)
    return result


def _leaves_block(node: OpNode, names: list[str], layer_of: dict, holds_shards) -> bool:
    """Whether partial sums reaching `node` have left the tensor-parallel block that made them, so
    the runtime has summed them already: in backward, at an op of a module without sharded weights
    (a norm before a block: the block's input gradient is all-reduced on entry, not after the norm's
    linear backward, which would carry it into the previous layer, or pipeline stage); in either
    phase, at an op of another layer than its producer's."""
    if node.phase == "backward" and node.module_path and not holds_shards(node.module_path):
        return True
    return any(layer_of.get(n) != node.layer for n in names if n in layer_of and not n.startswith("param:"))


def param_tp_dims(graph: OpGraph, status: dict[str, tuple[str, float]], sharded: set[str]) -> dict[str, int]:
    """Which dimension of each sharded parameter tensor parallelism splits, as stored.

    Column parallel splits the contraction's output features, row parallel its input features; a
    weight reached through a transpose (nn.Linear's [out, in]) has them the other way round.
    """
    by_name = {node.name: node for node in graph.nodes}
    dims: dict[str, int] = {}
    for node in graph.nodes:
        if node.phase != "forward":
            continue
        packet = op_packet(node)
        if packet == "embedding":
            dims.update({p: 0 for p in node.params if p in sharded and p not in dims})
            continue
        if packet not in CONTRACTIONS or len(node.input_names) <= max(CONTRACTIONS[packet]):
            continue
        operand = node.input_names[CONTRACTIONS[packet][1]]  # the weight-side operand
        transposed = False
        while operand in by_name and by_name[operand].is_view:
            transposed ^= op_packet(by_name[operand]) in ("t", "transpose", "permute")
            names = by_name[operand].input_names
            operand = names[0] if names else ""
        param = operand.removeprefix("param:")
        if not operand.startswith("param:") or param not in sharded or param in dims:
            continue
        column = status[node.name][0] == "S"
        operand_dim = 1 if column else 0  # operand is [in, out]: column splits out, row splits in
        dims[param] = 1 - operand_dim if transposed else operand_dim
    return dims
