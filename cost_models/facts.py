"""Graph facts the cost models read: the op graph condensed into pipeline units.

A unit is one repeated-layer instance, or a run of non-layer ops between layers (embedding before
the first layer, final norm + head + loss after the last). Units are what pipeline stages are cut
from. Each unit keeps its ops with per-sample work (the graph is traced at some batch B0; matmul,
attention and elementwise work and activation bytes are linear in the batch, weight reads are not).

Tensor parallelism is Megatron-style and derived from the graph, not from module names: which
matrices are sharded, and where partial sums are all-reduced, is propagated along data flow
(`tp_shards`), so the all-reduces that a row-parallel linear, a vocab-parallel embedding, or the
backward of a column-parallel linear need fall out of the graph. Which ops make up each unit, and
what a cut before it sends, are found by `units`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import cached_property

from autopar.cost_models.autocast import FLOATING, autocast_activation_factor, autocast_activations, autocast_bytes
from autopar.cost_models.context import AttentionLayer, attention_layers
from autopar.cost_models.experts import ExpertLayer, expert_layers
from autopar.cost_models.tp_shards import (CONTRACTIONS, column_biases, is_attention, op_packet, param_tp_dims,
                                           propagate_shards, sharded_params)
from autopar.cost_models.units import CutTensor, assign_units, cut_tensors, unit_input_bytes
from autopar.graph.ir import DTYPE_BYTES, OpGraph, OpNode, TensorMeta


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
    # A backward GEMM computing a weight's gradient (`weight_gradient_ops`): the W pass a zero-bubble
    # schedule runs apart from the input-gradient pass.
    weight_gradient: bool = False
    # Per sample, under autocast over fp32 weights (`cost_models.autocast`): a vector op's activation
    # bytes; a GEMM's or attention's, the casts of its inputs run before it. None: as traced.
    autocast_bytes: float | None = None
    # Kernels under autocast: a vector op's (0: a cast to the dtype its input has); a product's casts.
    autocast_kernels: int = 1
    # Per sample, what it keeps for backward under autocast (`autocast.autocast_saved_bytes`); None: as traced.
    autocast_saved_bytes: float | None = None
    # Per sample, the outputs of a forward GEMM with a weight (a projection) or of fused attention,
    # which selective recompute's policy keeps whether or not backward reads them (`runtime.recompute`);
    # 0 for other ops (a product of two activations, such as unfused attention's scores, is the
    # attention core Megatron-LM's selective recompute rebuilds; the runtime runs attention fused).
    output_bytes: float = 0.0
    # Per sample, of `saved_bytes`: this op's outputs that a column-parallel projection (a product whose
    # output tp shards) reads and keeps. Under sequence parallelism the runtime gathers them whole for
    # the projection, which keeps the gathered tensor (measured on gloo: `gathered_input_bytes`); the
    # rest of what the op keeps stays a sequence shard. `autocast_gathered_bytes`: the same at
    # autocast's dtypes (each projection's 16-bit copy); None: as traced.
    gathered_bytes: float = 0.0
    autocast_gathered_bytes: float | None = None
    # How many projections read those outputs. Under autocast each casts its own 16-bit copy, and
    # `autocast_saved_bytes` keeps them all; the module rules cast a block's input once for all of a
    # module's projections (`module_rules._BlockInput`; measured: tests/test_tp_memory.py), so one copy
    # per module that reads them as its input: `gathered_blocks`, the copies kept (a parallel block's
    # shared norm feeds two modules, attention and MLP; projections reading another tensor, such as
    # cross attention's encoder states, one copy each). Under sequence parallelism each module gathers
    # its own copy too.
    gathered_readers: int = 0
    gathered_blocks: int = 0

    def reduce_bytes_for(self, batch: float, share: float = 1.0) -> float:
        """`share`: of each sequence's positions, the rank's (1/cp under context parallelism): a
        position table's lookup reduces only the rows of those positions."""
        return self.reduce_bytes * share if self.reduce_per_microbatch else self.reduce_bytes * batch


@dataclass(frozen=True)
class GemmShape:
    """(count, m, n, k) per sample: `count` independent [m, k]·[k, n] products. The dimension
    `scaled` grows with the micro-batch (the one holding the tokens, or the batched count), the
    others are fixed; `split` is the one tensor parallelism divides (-1 when none)."""

    dims: tuple[float, float, float, float]
    scaled: int
    split: int = -1
    # (width, padded width) of a linear layer the runtime computes padded (`autopar.graph.paddable`):
    # the dimension of this product equal to `width` runs at the padded one, aligned
    padding: tuple[int, int] | None = None

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
    # Replicated tables read elementwise along the sequence (a position table of shape (seq, hidden)
    # added to the stream), elements per tensor: under sequence parallelism each rank's gradient is
    # its positions' rows, gathered whole at each gradient sync (`runtime.parallelize._match_gradient_placements`
    # once a step; FSDP's reduce-scatters under ZeRO: `collectives.sequence_indexed_gradient_gathers`).
    sequence_indexed_params: tuple[int, ...] = ()
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
    # A linear layer's product here the runtime may pad (`GemmShape.padding`)
    padded_gemms: bool = False
    # Parallel to param_shapes: False for a parameter no op reads. It gets no gradient, so FSDP2
    # reduce-scatters nothing for it; a dp bucket still all-reduces its (zero) gradient.
    param_read: tuple[bool, ...] = ()
    # Parallel to param_shapes: True for a table an embedding lookup reads (`backward_memory.lookup_gradient_bytes`).
    param_looked_up: tuple[bool, ...] = ()
    # Per sample, `input_bytes` at autocast's dtypes (the fp32 residual); None: not counted (fp32 trace).
    autocast_input_bytes: float | None = None

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
    # bytes kept for backward under autocast per traced byte (`autocast.autocast_activation_factor`);
    # None: not counted (an fp32 trace, facts built by hand), `memory.AUTOCAST_ACTIVATION_FACTOR` applies
    autocast_activation_factor: float | None = None
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
    sharded = sharded_params(graph, params) if sharded is None else set(sharded)
    unit_of = assign_units(graph)
    status = propagate_shards(graph, sharded, unit_of)
    per_sample = 1.0 / max(graph.batch, 1)

    tokens = max(graph.batch, 1) * (graph.seq_len or 1)
    ops_by_unit: dict[str, list[OpFacts]] = {}
    weight_gradients = weight_gradient_ops(graph)
    under_autocast = autocast_bytes(graph)
    saved_under_autocast, autocast_dtypes = autocast_activations(graph)
    gathered = gathered_input_bytes(graph, status, autocast_dtypes)
    for node in graph.nodes:
        op = _op_facts(node, status, param_bytes, per_sample,
                       _gemm_shape(node, status, sharded, graph.batch, tokens, graph.padded_linears),
                       node.name in weight_gradients)
        if node.name in under_autocast and op.kind != "view":
            autocast = under_autocast[node.name]
            op = dataclasses.replace(op, autocast_bytes=autocast.moved_bytes * per_sample,
                                     autocast_kernels=autocast.kernels)
        if autocast_dtypes and node.phase == "forward":
            op = dataclasses.replace(op, autocast_saved_bytes=saved_under_autocast.get(node.name, 0.0) * per_sample)
        if node.name in gathered:
            traced_bytes, autocast_copies, readers, blocks = gathered[node.name]
            op = dataclasses.replace(op, gathered_bytes=traced_bytes * per_sample,
                                     autocast_gathered_bytes=autocast_copies * per_sample if autocast_dtypes else None,
                                     gathered_readers=readers, gathered_blocks=blocks)
        ops_by_unit.setdefault(unit_of[node.name], []).append(op)
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
    first_input = unit_input_bytes(graph, unit_of, per_sample)
    autocast_input = unit_input_bytes(graph, unit_of, per_sample, autocast_dtypes) if autocast_dtypes else None
    cuts = cut_tensors(graph, unit_of, order, per_sample, autocast_dtypes)
    looked_up = {p for node in graph.nodes if node.phase == "forward" and op_packet(node) == "embedding"
                 for p in node.params}
    elementwise_read = {p for node in graph.nodes if node.phase == "forward"
                        and op_packet(node) not in CONTRACTIONS and op_packet(node) != "embedding" for p in node.params}
    # read along the sequence: a table whose second-to-last dimension is the sequence's (seq, hidden)
    by_position = {p.name for p in graph.params if graph.seq_len and len(p.shape) >= 2 and p.shape[-2] == graph.seq_len}
    tp_dims = param_tp_dims(graph, status, sharded)
    counted = sharded | column_biases(graph, tp_dims)  # what the runtime divides over tp
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
            sequence_parallel_params=sum(params[p].numel for p, u in owner.items() if u == name
                                         and p not in sharded and p in elementwise_read and p not in by_position),
            sequence_parallel_tensors=sum(1 for p, u in owner.items() if u == name
                                          and p not in sharded and p in elementwise_read and p not in by_position),
            sequence_indexed_params=tuple(params[p].numel for p, u in owner.items() if u == name
                                          and p not in sharded and p in elementwise_read and p in by_position),
            borrowed=tuple((owner[p], params[p].numel, p in counted)
                           for p in sorted(read_by.get(name, ())) if owner[p] != name),
            cut=cuts.get(name, ()),
            param_shapes=tuple((tuple(params[p].shape), tp_dims.get(p, 0) if p in counted else None)
                               for p, u in owner.items() if u == name),
            param_trainable=tuple(params[p].trainable for p, u in owner.items() if u == name),
            param_read=tuple(p in read_anywhere for p, u in owner.items() if u == name),
            param_looked_up=tuple(p in looked_up for p, u in owner.items() if u == name),
            padded_gemms=any(op.gemm is not None and op.gemm.padding is not None for op in ops_by_unit[name]),
            autocast_input_bytes=None if autocast_input is None else autocast_input.get(name, 0.0),
        )
        for name in order
    )
    return ModelFacts(
        model_name=graph.model_name, precision=graph.precision, seq_len=graph.seq_len or 1, units=units,
        num_params=graph.num_params, heads=heads, kv_heads=kv_heads, vocab=vocab,
        param_tp_dims=tp_dims, experts=expert_layers(graph, unit_of), attention=attention_layers(graph, unit_of),
        autocast_activation_factor=autocast_activation_factor(graph),
    )


def _gemm_shape(node: OpNode, status: dict, sharded: set[str], batch: int, tokens: int,
                padded: dict[str, tuple[int, int]] | None = None) -> GemmShape | None:
    """The GEMM a matmul op runs, per sample: the traced batch `batch` divided out of the dimension
    that holds it (the tokens, `tokens` = batch × sequence, for a 2-D product; the count for a
    batched one), and the dimension tp splits, read off the operands' shard status as
    `propagate_shards` assigns it (both operands sharded: the contraction, or a batched product's
    count of heads; one: that operand's free dimension)."""
    packet = op_packet(node)
    if packet not in CONTRACTIONS or not node.flops:
        return None
    a, b = CONTRACTIONS[packet]
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
    padding = padded.get(node.module_path) if padded else None
    if padding is not None and padding[0] not in dims[1:]:  # not the layer's product itself
        padding = None
    dims[scaled] /= max(batch, 1)
    return GemmShape((dims[0], dims[1], dims[2], dims[3]), scaled, split, padding)


def weight_gradient_ops(graph: OpGraph) -> set[str]:
    """The backward GEMMs computing a weight's gradient (the W pass of Qi et al., "Zero Bubble Pipeline
    Parallelism", ICLR 2024, §2): they read no parameter and produce a tensor shaped like a parameter
    (or its transpose) of the module they differentiate; the input-gradient GEMMs (B) read the weight."""
    shapes: dict[str, set[tuple[int, ...]]] = {}
    for param in graph.params:
        for name in (param.name, *param.aliases):  # a tied head differentiates the embedding's weight
            shapes.setdefault(name.rpartition(".")[0], set()).update({tuple(param.shape), tuple(param.shape[::-1])})
    return {node.name for node in graph.nodes
            if node.phase == "backward" and node.flops and not node.params and not is_attention(node)
            and node.output_meta and tuple(node.output_meta[0].shape) in shapes.get(node.module_path, ())}


def gathered_input_bytes(graph: OpGraph, status: dict, autocast_dtypes: dict[str, list[str]]
                         ) -> dict[str, tuple[float, float, int, int]]:
    """Per forward node, (traced bytes, bytes under autocast, projections reading them, the modules those
    belong to: one `_BlockInput` each under the module rules) of its outputs that a column-parallel
    projection reads: a forward product with a weight whose output tp shards (`status`). Under sequence
    parallelism the runtime all-gathers such an input whole for the projection, and the projection keeps
    the gathered tensor for its weight's gradient (under selective recompute too: the gather's output is
    one of the ops the policy saves, `runtime.recompute`). Measured on two gloo ranks: a GPT layer at
    tp = 2 with sequence parallelism keeps its two norms' outputs whole, the rest as sequence shards
    (`tests/test_tp_memory.py`). A tensor read by several projections is gathered once: under autocast
    it is cast to 16 bits once, before the gather (`runtime/tensor_parallel/autocast.py`).
    Known to over-count on MoE layers (an expert's product reads tokens that are already sharded),
    which the runtime does not run with tp."""
    producer = {node.name: node for node in graph.nodes}

    def root(name: str) -> str:
        while name in producer and producer[name].is_view and producer[name].input_names:
            name = producer[name].input_names[0]
        return name

    low = 2  # bytes of a 16-bit copy
    read: dict[tuple[str, tuple], TensorMeta] = {}
    readers: dict[str, dict[str, list[str]]] = {}  # base -> module -> its projections reading it
    module_input: dict[str, str] = {}  # module -> what its first projection reads: the input it casts
    for node in graph.nodes:
        if node.phase != "forward" or not node.flops or not node.params or status[node.name][0] != "S":
            continue
        module = node.module_path.rpartition(".")[0]  # where the module rules put the block's `_BlockInput`
        for name, meta in zip(node.input_names, node.input_meta):
            base = root(name)
            if base in producer and producer[base].phase == "forward" and meta.dtype in FLOATING:
                read.setdefault((base, tuple(meta.shape)), meta)
                names = readers.setdefault(base, {}).setdefault(module, [])
                if node.name not in names:
                    names.append(node.name)
                module_input.setdefault(module, base)
    result: dict[str, tuple[float, float, int, int]] = {}
    for (base, _), meta in read.items():
        traced, autocast, _, _ = result.get(base, (0.0, 0.0, 0, 0))
        by_module = readers[base]
        # a module casts its own input once for all its projections; what else they read (cross
        # attention's encoder states) each projection casts for itself
        copies = sum(1 if module_input[module] == base else len(names) for module, names in by_module.items())
        result[base] = (traced + meta.bytes, autocast + meta.numel * low,
                        sum(len(names) for names in by_module.values()), copies)
    return result


def _op_facts(node: OpNode, status: dict, param_bytes: dict[str, int], per_sample: float,
              gemm: GemmShape | None = None, weight_gradient: bool = False) -> OpFacts:
    out, reduce_bytes = status[node.name]
    weight = float(sum(param_bytes.get(p, 0) for p in node.params))
    moved = max(node.bytes_read + node.bytes_written - weight, 0.0)
    if node.is_view:
        kind = "view"
    elif is_attention(node):
        kind = "attention"
    elif node.flops:
        kind = "matmul"
    else:
        kind = "vector"
    # Split work: a sharded result, or a contraction whose partial sums each rank computes a share
    # of. An elementwise op on partial sums (adding two of them) is full-size work on every rank.
    sharded = out == "S" or (out == "P" and kind in ("matmul", "attention"))
    unbatched = op_packet(node) == "embedding" and bool(node.output_meta) and len(node.output_meta[0].shape) == 2
    return OpFacts(
        name=node.name, phase=node.phase, kind=kind, flops=node.flops * per_sample,
        activation_bytes=moved * per_sample, weight_bytes=weight, tp_sharded=sharded,
        reduce_bytes=reduce_bytes if unbatched else reduce_bytes * per_sample,
        saved_bytes=node.saved_bytes * per_sample, saved_sharded=out == "S", reduce_per_microbatch=unbatched,
        gemm=gemm if kind == "matmul" else None, weight_gradient=weight_gradient,
        output_bytes=sum(m.bytes for m in node.output_meta) * per_sample
        if node.phase == "forward" and (kind == "attention" or (kind == "matmul" and weight)) else 0.0,
    )
