"""Graph facts the cost models read: the op graph condensed into pipeline units.

A unit is one repeated-layer instance, or a run of non-layer ops between layers (embedding before
the first layer, final norm + head + loss after the last). Units are what pipeline stages are cut
from. Each unit keeps its ops with per-sample work (the graph is traced at some batch B0; matmul,
attention and elementwise work and activation bytes are linear in the batch, weight reads are not).

Tensor parallelism is Megatron-style and derived from the graph, not from module names: every
2-D parameter read by a matmul or an embedding is sharded over tp; sharding then propagates along
data flow. An op with one sharded operand of a contraction yields a sharded result (column
parallel); two sharded operands contract over the sharded dimension and yield partial sums (row
parallel); partial sums flow through linear ops (add, scale, views) and are all-reduced where a
non-linear op first needs the full value. So the all-reduces that a row-parallel linear, a
vocab-parallel embedding, or the backward of a column-parallel linear need fall out of the graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from autopar.cost_models.context import AttentionLayer, attention_layers
from autopar.cost_models.experts import ExpertLayer, expert_layers
from autopar.graph.ir import DTYPE_BYTES, OpGraph, OpNode, TensorMeta

_CONTRACTIONS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2), "convolution": (0, 1)}
_LINEAR = {"add", "sub", "mul", "div", "neg", "sum", "mean", "clone", "_to_copy", "copy", "cat", "expand", "view"}
_ATTENTION_MARKERS = ("scaled_dot_product", "flash_attention", "efficient_attention")


@dataclass(frozen=True)
class OpFacts:
    """One op's work, per sample of the batch, and how tensor parallelism treats it."""

    name: str
    phase: str
    kind: str  # matmul | attention | vector | view
    flops: float
    activation_bytes: float  # read + written, excluding weights
    weight_bytes: float  # parameters read: independent of the batch
    tp_sharded: bool  # its work divides over tp
    reduce_bytes: float  # partial sums all-reduced over tp before this op runs
    saved_bytes: float  # kept from forward for backward
    saved_sharded: bool
    # Other tp-group collectives this op needs first (kind, bytes per sample), e.g. the all-gather
    # or all-to-all an intra-op sharding plan inserts; empty for the Megatron-style propagation.
    collectives: tuple[tuple[str, float], ...] = ()
    # reduce_bytes is per micro-batch, not per sample: a lookup without a batch dimension (a
    # position table indexed by positions) reduces the same rows whatever the batch.
    reduce_per_microbatch: bool = False
    # A matmul's GEMM shape for one sample on one rank: (batch count, m, n, k) at tp = 1, which of
    # the four grows with the micro-batch and which tp divides (index, or -1: none). None when the
    # shape is not known (convolutions): the roofline then prices it at the large-GEMM efficiency.
    gemm: GemmShape | None = None

    def reduce_bytes_for(self, batch: float, share: float = 1.0) -> float:
        """`share`: of each sequence's positions, the rank's (1/cp under context parallelism): a
        position table's lookup reduces only the rows of those positions."""
        return self.reduce_bytes * share if self.reduce_per_microbatch else self.reduce_bytes * batch


class CutTensor(NamedTuple):
    """One tensor crossing a pipeline cut."""

    bytes: float  # per sample when `per_sample`, else per micro-batch
    grad: bool  # its gradient is sent back (a parameter flows into it and it is floating)
    # It grows with the batch: it depends on the model's inputs. A tensor made from weights and
    # positions alone (T5's relative position bias) is the same size for any micro-batch.
    per_sample: bool = True

    def bytes_for(self, batch: int) -> float:
        return self.bytes * batch if self.per_sample else self.bytes


@dataclass(frozen=True)
class GemmShape:
    """(count, m, n, k) per sample: `count` independent [m, k]·[k, n] products. The dimension
    `scaled` grows with the micro-batch (the one holding the tokens, or the batched count), the
    others are fixed; `split` is the one tensor parallelism divides (-1 when none)."""

    dims: tuple[float, float, float, float]
    scaled: int
    split: int = -1

    def at(self, batch: int, tp: int) -> tuple[float, float, float, float]:
        """The (count, m, n, k) one rank runs for a micro-batch of `batch` samples."""
        dims = list(self.dims)
        dims[self.scaled] *= batch
        if self.split >= 0 and tp > 1:
            dims[self.split] /= tp
        return dims[0], dims[1], dims[2], dims[3]


@dataclass(frozen=True)
class Unit:
    """A pipeline-cuttable piece of the model."""

    name: str  # layer instance path, or "pre" / "post" / "between.N"
    layer_type: str | None
    ops: tuple[OpFacts, ...]
    params: int  # parameters owned (tied ones counted where first read)
    sharded_params: int  # of which tp shards
    input_bytes: float  # per sample: the activation entering the unit (what a pipeline send moves)
    # Replicated weights read by elementwise ops (norms): under sequence parallelism they see a
    # sequence shard, so their gradients are summed over tp once per step.
    sequence_parallel_params: int = 0
    sequence_parallel_tensors: int = 0
    # Tied weights this unit reads but another unit owns: (owner unit, elements, tp-sharded). A
    # pipeline rank that holds this unit without the owner keeps a copy (and syncs its gradient).
    borrowed: tuple[tuple[str, int, bool], ...] = ()
    # What a pipeline cut placed just before this unit sends forward: each tensor made before the
    # cut and read after it. Tensors computed from the inputs and buffers alone (masks, positions)
    # are not sent: every stage recomputes them.
    cut: tuple[CutTensor, ...] = ()
    # Each owned parameter's shape and the dimension tp splits (None: replicated over tp): FSDP2
    # pads a tensor's first dimension to a multiple of dp, and its collectives move the padding.
    param_shapes: tuple[tuple[tuple[int, ...], int | None], ...] = ()
    # Parallel to param_shapes: False for a frozen parameter (requires_grad off), which has no
    # gradient to all-reduce or reduce-scatter (Whisper's sinusoidal position table).
    param_trainable: tuple[bool, ...] = ()
    # Parallel to param_shapes: False for a parameter no op reads. It gets no gradient, so FSDP2
    # reduce-scatters nothing for it; a dp bucket still all-reduces its (zero) gradient.
    param_read: tuple[bool, ...] = ()

    def params_on_device(self, tp: int) -> float:
        """Parameters one tp rank holds: its shard of the sharded ones, all of the rest."""
        return self.sharded_params / tp + (self.params - self.sharded_params)

    def frozen_on_device(self, tp: int) -> float:
        """Of `params_on_device`, the elements of frozen parameters (held, never synced)."""
        return sum(math.prod(shape) / (tp if tp_dim is not None else 1)
                   for (shape, tp_dim), trainable in zip(self.param_shapes, self.param_trainable) if not trainable)

    def trainable_on_device(self, tp: int) -> float:
        """Parameters one tp rank holds whose gradients data parallelism syncs."""
        return self.params_on_device(tp) - self.frozen_on_device(tp)

    def fsdp_reduced_params(self, tp: int, dp: int) -> float:
        """Elements an FSDP2 reduce-scatter moves: the gathered ones less the parameters with no
        gradient, frozen or unread (each padded as in `fsdp_gathered_params`)."""
        read = self.param_read or (True,) * len(self.param_shapes)
        without = sum(-(-shape[0] // dp) * dp * math.prod(shape[1:]) if (tp_dim is None or tp == 1) and shape
                      else math.prod(shape) / (tp if tp_dim is not None else 1)
                      for (shape, tp_dim), trainable, is_read in zip(self.param_shapes, self.param_trainable, read)
                      if not (trainable and is_read))
        return self.fsdp_gathered_params(tp, dp) - without

    def fsdp_gathered_params(self, tp: int, dp: int) -> float:
        """Elements an FSDP2 all-gather (or reduce-scatter) of this unit's tp-local parameters moves
        over dp ranks: each tensor's first dimension is split in dp equal chunks, the last one padded
        (ViT's [1, 1, hidden] class token moves as [2, 1, hidden] at dp=2). The padding is counted
        for parameters tp does not split; a tp shard's rows are assumed to divide by dp (placements
        chosen later than these facts may split other tensors); at tp = 1 nothing is split, so every
        tensor's padding is counted (a MoE router's [2 experts, hidden] moves as 4 rows at dp=4)."""
        padding = 0
        for shape, tp_dim in self.param_shapes:
            if (tp_dim is None or tp == 1) and shape:
                padding += (-(-shape[0] // dp) * dp - shape[0]) * math.prod(shape[1:])
        return self.params_on_device(tp) + padding

    @cached_property
    def forward_ops(self) -> tuple[OpFacts, ...]:
        return tuple(op for op in self.ops if op.phase == "forward")

    @cached_property
    def backward_ops(self) -> tuple[OpFacts, ...]:
        return tuple(op for op in self.ops if op.phase == "backward")


@dataclass(frozen=True)
class ModelFacts:
    model_name: str
    precision: str
    seq_len: int
    units: tuple[Unit, ...]
    num_params: int
    heads: int | None = None
    kv_heads: int | None = None
    vocab: int | None = None
    param_tp_dims: dict[str, int] = field(default_factory=dict)  # tensor-parallel shard dim of each sharded parameter
    experts: tuple[ExpertLayer, ...] = ()  # MoE layers, for expert parallelism
    attention: tuple[AttentionLayer, ...] = ()  # attention calls, for context parallelism
    extra: dict = field(default_factory=dict)

    @property
    def layer_units(self) -> list[int]:
        return [i for i, unit in enumerate(self.units) if unit.layer_type is not None]

    @cached_property
    def flops_per_sample(self) -> float:
        """Model FLOPs of one sample's forward and backward (recompute not counted)."""
        return sum(op.flops for unit in self.units for op in unit.ops)


def model_facts(graph: OpGraph, heads: int | None = None, kv_heads: int | None = None,
                vocab: int | None = None, sharded: set[str] | frozenset[str] | None = None) -> ModelFacts:
    """Condense an op graph into units with tp-aware per-op facts. `sharded` replaces Megatron's
    choice of tp-sharded matrices (every one a matmul or an embedding reads) for plans that give
    per-parameter placements: which ops' work divides over tp then follows those placements."""
    params = {p.name: p for p in graph.params}
    param_bytes = {p.name: p.numel * DTYPE_BYTES.get(p.dtype, 4) for p in graph.params}
    sharded = _sharded_params(graph, params) if sharded is None else set(sharded)
    unit_of = _assign_units(graph)
    status = _propagate(graph, sharded, unit_of)
    per_sample = 1.0 / max(graph.batch, 1)

    tokens = max(graph.batch, 1) * (graph.seq_len or 1)
    ops_by_unit: dict[str, list[OpFacts]] = {}
    for node in graph.nodes:
        ops_by_unit.setdefault(unit_of[node.name], []).append(
            _op_facts(node, status, param_bytes, per_sample, _gemm_shape(node, status, sharded, graph.batch, tokens))
        )
    order = list(dict.fromkeys(unit_of[n.name] for n in graph.nodes if n.phase == "forward"))
    order += [name for name in ops_by_unit if name not in order]
    layer_type_of = {inst: lt.id for lt in graph.layer_types for inst in lt.instances}

    owner: dict[str, str] = {}  # parameter → the unit that first reads it
    for node in graph.nodes:
        for name in node.params:
            owner.setdefault(name, unit_of[node.name])
    read_anywhere = set(owner)
    for name in params:  # held (and synced, when trainable) though no op reads it: BEiT's unused mask token
        if name not in owner and order:
            owner[name] = order[0]
    first_input = _unit_input_bytes(graph, unit_of, per_sample)
    cuts = _cut_tensors(graph, unit_of, order, per_sample)
    elementwise_read = {p for node in graph.nodes if node.phase == "forward"
                        and _packet(node) not in _CONTRACTIONS and _packet(node) != "embedding" for p in node.params}
    tp_dims = _param_tp_dims(graph, status, sharded)
    counted = sharded | _column_biases(graph, tp_dims)  # what the runtime divides over tp
    read_by: dict[str, set[str]] = {}
    for node in graph.nodes:
        if node.phase == "forward":
            for name in node.params:
                read_by.setdefault(unit_of[node.name], set()).add(name)
    units = tuple(
        Unit(
            name=name,
            layer_type=layer_type_of.get(name),
            ops=tuple(ops_by_unit[name]),
            params=sum(params[p].numel for p, u in owner.items() if u == name),
            sharded_params=sum(params[p].numel for p, u in owner.items() if u == name and p in counted),
            input_bytes=first_input.get(name, 0.0),
            sequence_parallel_params=sum(params[p].numel for p, u in owner.items()
                                         if u == name and p not in sharded and p in elementwise_read),
            sequence_parallel_tensors=sum(1 for p, u in owner.items()
                                          if u == name and p not in sharded and p in elementwise_read),
            borrowed=tuple((owner[p], params[p].numel, p in counted)
                           for p in sorted(read_by.get(name, ())) if owner[p] != name),
            cut=cuts.get(name, ()),
            param_shapes=tuple((tuple(params[p].shape), tp_dims.get(p, 0) if p in counted else None)
                               for p, u in owner.items() if u == name),
            param_trainable=tuple(params[p].trainable for p, u in owner.items() if u == name),
            param_read=tuple(p in read_anywhere for p, u in owner.items() if u == name),
        )
        for name in order
    )
    return ModelFacts(
        model_name=graph.model_name, precision=graph.precision, seq_len=graph.seq_len or 1, units=units,
        num_params=graph.num_params, heads=heads, kv_heads=kv_heads, vocab=vocab,
        param_tp_dims=tp_dims, experts=expert_layers(graph, unit_of), attention=attention_layers(graph, unit_of),
    )


def _column_biases(graph: OpGraph, tp_dims: dict[str, int]) -> set[str]:
    """Biases of column-parallel weights: split with the output features (the runtime shards them)."""
    return {p.name for p in graph.params if len(p.shape) == 1 and p.name.endswith(".bias")
            and tp_dims.get(p.name.removesuffix(".bias") + ".weight") == 0}


def _packet(node: OpNode) -> str:
    parts = node.op.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else node.op


def _is_attention(node: OpNode) -> bool:
    return any(marker in node.op for marker in _ATTENTION_MARKERS)


def _sharded_params(graph: OpGraph, params: dict) -> set[str]:
    sharded: set[str] = set()
    for node in graph.nodes:
        packet = _packet(node)
        if packet in _CONTRACTIONS or packet == "embedding":
            sharded.update(p for p in node.params if len(params[p].shape) == 2)
    return sharded


def _propagate(graph: OpGraph, sharded: set[str], unit_of: dict[str, str] | None = None
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

        packet = _packet(node)
        if not node.is_view and "P" in arg_status and _leaves_block(node, names, layer_of, holds_shards):
            reduce_inputs(list(range(len(arg_status))))
        if node.is_view:
            out = arg_status[0] if arg_status else "R"
            if names:
                root[node.name] = root.get(names[0], names[0])
        elif packet in _CONTRACTIONS and len(arg_status) >= max(_CONTRACTIONS[packet]) + 1:
            a, b = _CONTRACTIONS[packet]
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
        elif _is_attention(node):
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


def _gemm_shape(node: OpNode, status: dict, sharded: set[str], batch: int, tokens: int) -> GemmShape | None:
    """The GEMM a matmul op runs, per sample: the traced batch `batch` divided out of the dimension
    that holds it (the tokens, `tokens` = batch × sequence, for a 2-D product; the count for a
    batched one), and the dimension tp splits, read off the operands' shard status as
    `_propagate` assigns it (both operands sharded: the contraction, or a batched product's
    count of heads; one: that operand's free dimension)."""
    packet = _packet(node)
    if packet not in _CONTRACTIONS or not node.flops:
        return None
    a, b = _CONTRACTIONS[packet]
    if len(node.input_meta) <= b:
        return None
    left, right = node.input_meta[a].shape, node.input_meta[b].shape
    names = node.input_names

    def sharded_operand(i: int) -> bool:
        name = names[i] if i < len(names) else ""
        if name.startswith("param:"):
            return name.removeprefix("param:") in sharded
        return status.get(name, ("R", 0.0))[0] == "S"

    pair = (sharded_operand(a), sharded_operand(b))
    if len(left) == 2 and len(right) == 2:
        dims = [1.0, float(left[0]), float(right[1]), float(left[1])]
        scaled = next((i for i in (1, 3, 2) if dims[i] == tokens),
                      next((i for i in (1, 3, 2) if dims[i] % tokens == 0), 1))
        split = 3 if all(pair) else 1 if pair[0] else 2 if pair[1] else -1
    elif len(left) == 3 and len(right) == 3:
        dims = [float(left[0]), float(left[1]), float(right[2]), float(left[2])]
        scaled = 0
        split = 0 if all(pair) else 1 if pair[0] else 2 if pair[1] else -1
    else:
        return None
    dims[scaled] /= max(batch, 1)
    return GemmShape((dims[0], dims[1], dims[2], dims[3]), scaled, split)


def _op_facts(node: OpNode, status: dict, param_bytes: dict[str, int], per_sample: float,
              gemm: GemmShape | None = None) -> OpFacts:
    out, reduce_bytes = status[node.name]
    weight = float(sum(param_bytes.get(p, 0) for p in node.params))
    moved = max(node.bytes_read + node.bytes_written - weight, 0.0)
    if node.is_view:
        kind = "view"
    elif _is_attention(node):
        kind = "attention"
    elif node.flops:
        kind = "matmul"
    else:
        kind = "vector"
    # Split work: a sharded result, or a contraction whose partial sums each rank computes a share
    # of. An elementwise op on partial sums (adding two of them) is full-size work on every rank.
    sharded = out == "S" or (out == "P" and kind in ("matmul", "attention"))
    unbatched = _packet(node) == "embedding" and bool(node.output_meta) and len(node.output_meta[0].shape) == 2
    return OpFacts(
        name=node.name, phase=node.phase, kind=kind, flops=node.flops * per_sample,
        activation_bytes=moved * per_sample, weight_bytes=weight, tp_sharded=sharded,
        reduce_bytes=reduce_bytes if unbatched else reduce_bytes * per_sample,
        saved_bytes=node.saved_bytes * per_sample, saved_sharded=out == "S", reduce_per_microbatch=unbatched,
        gemm=gemm if kind == "matmul" else None,
    )


def _assign_units(graph: OpGraph) -> dict[str, str]:
    """Layer ops go to their instance; other forward ops to the run they sit in; backward ops
    follow the forward unit of their module (the loss seed and other orphans: the last unit)."""
    unit_of: dict[str, str] = {}
    module_unit: dict[str, str] = {}
    runs = 0
    current = "pre"
    seen_layer = False
    for node in graph.nodes:
        if node.phase != "forward":
            continue
        if node.layer is not None:
            unit_of[node.name] = node.layer
            seen_layer = True
            current = None  # the next non-layer op starts a new run
            continue
        if current is None:
            runs += 1
            current = f"between.{runs}"
        unit_of[node.name] = current if seen_layer or current == "pre" else "pre"
        module_unit.setdefault(node.module_path, unit_of[node.name])
    last_run = f"between.{runs}" if runs else "pre"
    renamed = {last_run: "post"} if runs else {}
    for node in graph.nodes:
        if node.phase == "forward":
            continue
        if node.layer is not None:
            unit_of[node.name] = node.layer
            continue
        path = node.module_path
        while path and path not in module_unit:
            path = path.rpartition(".")[0]
        unit_of[node.name] = module_unit.get(path, last_run) if path else last_run
    return {name: renamed.get(unit, unit) for name, unit in unit_of.items()}


def _unit_input_bytes(graph: OpGraph, unit_of: dict[str, str], per_sample: float) -> dict[str, float]:
    """Bytes of forward activations that enter each unit from an earlier unit."""
    producer_unit = {n.name: unit_of[n.name] for n in graph.nodes}
    sizes: dict[str, float] = {}
    output_bytes = {n.name: sum(m.bytes for m in n.output_meta) for n in graph.nodes}
    for node in graph.nodes:
        if node.phase != "forward":
            continue
        unit = unit_of[node.name]
        for source in node.inputs:
            source_unit = producer_unit.get(source)
            if source_unit is not None and source_unit != unit:
                sizes.setdefault(unit, 0.0)
                sizes[unit] = max(sizes[unit], output_bytes[source] * per_sample)
    return sizes


_FLOATING = {"float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"}


def _cut_tensors(graph: OpGraph, unit_of: dict[str, str], order: list[str], per_sample: float
                 ) -> dict[str, tuple[CutTensor, ...]]:
    """Per unit: the forward tensors crossing a pipeline cut placed just before it (see `Unit.cut`),
    in the order their producers ran. A tensor is recomputable when no parameter flows into it (the
    runtime's stages recompute those). Known gap: traced at batch 1, a tensor made from weights
    alone but expanded to the batch is priced as one sample's, whatever the micro-batch."""
    position = {unit: i for i, unit in enumerate(order)}
    forward = [node for node in graph.nodes if node.phase == "forward"]
    recomputable: set[str] = set()
    from_params: set[str] = set()
    from_inputs: set[str] = set()
    for node in forward:
        names = node.inputs
        if all(n in recomputable or n.startswith(("input:", "buffer:", "const:")) for n in names):
            recomputable.add(node.name)
        if any(n.startswith("param:") or n in from_params for n in names):
            from_params.add(node.name)
        if any(n.startswith("input:") or n in from_inputs for n in names):
            from_inputs.add(node.name)
    produced_at = {node.name: position[unit_of[node.name]] for node in forward}
    last_read: dict[tuple, int] = {}  # (producer, shape, dtype) -> the last unit reading it
    for node in forward:
        reader = position[unit_of[node.name]]
        for name, meta in zip(node.input_names or node.inputs, node.input_meta):
            if name in produced_at and name not in recomputable and produced_at[name] < reader:
                key = (name, meta.shape, meta.dtype)
                last_read[key] = max(last_read.get(key, reader), reader)
    result: dict[str, list[CutTensor]] = {}
    for (name, shape, dtype), reader in sorted(last_read.items(), key=lambda item: produced_at[item[0][0]]):
        # Made from the inputs, or expanded to the batch (learned queries, decoder ids built to the
        # batch size): only a traced batch of 2 or more tells the latter from a weight-made tensor.
        batched = name in from_inputs or (graph.batch > 1 and bool(shape) and shape[0] == graph.batch)
        size = TensorMeta(shape=shape, dtype=dtype).bytes * (per_sample if batched else 1.0)
        tensor = CutTensor(size, dtype in _FLOATING and name in from_params, batched)
        for cut in range(produced_at[name] + 1, reader + 1):
            result.setdefault(order[cut], []).append(tensor)
    return {unit: tuple(tensors) for unit, tensors in result.items()}


def _param_tp_dims(graph: OpGraph, status: dict[str, tuple[str, float]], sharded: set[str]) -> dict[str, int]:
    """Which dimension of each sharded parameter tensor parallelism splits, as stored.

    Column parallel splits the contraction's output features, row parallel its input features; a
    weight reached through a transpose (nn.Linear's [out, in]) has them the other way round.
    """
    by_name = {node.name: node for node in graph.nodes}
    dims: dict[str, int] = {}
    for node in graph.nodes:
        if node.phase != "forward":
            continue
        packet = _packet(node)
        if packet == "embedding":
            dims.update({p: 0 for p in node.params if p in sharded and p not in dims})
            continue
        if packet not in _CONTRACTIONS or len(node.input_names) <= max(_CONTRACTIONS[packet]):
            continue
        operand = node.input_names[_CONTRACTIONS[packet][1]]  # the weight-side operand
        transposed = False
        while operand in by_name and by_name[operand].is_view:
            transposed ^= _packet(by_name[operand]) in ("t", "transpose", "permute")
            names = by_name[operand].input_names
            operand = names[0] if names else ""
        param = operand.removeprefix("param:")
        if not operand.startswith("param:") or param not in sharded or param in dims:
            continue
        column = status[node.name][0] == "S"
        operand_dim = 1 if column else 0  # operand is [in, out]: column splits out, row splits in
        dims[param] = 1 - operand_dim if transposed else operand_dim
    return dims
