"""The bytes each op of a 16-bit trace moves when the runtime runs it under autocast over fp32 weights.

The graph is traced with every weight and activation in the compute dtype. autopar's runtime without
ZeRO instead runs `torch.autocast` over fp32 weights (`memory.autocast_states`): GEMMs and attention
cast their inputs to 16 bits and return 16 bits, the norms and the loss run in fp32, and every other
op computes in the widest dtype it reads. So the residual stream stays fp32, an fp32 activation is
cast apart before each GEMM that reads it, and its gradient is cast back. On one H200 these vector
ops took 2.3× what the 16-bit trace priced (README, seventh session); counted on fake tensors
(`benchmarks/autocast_bytes.py`) GPT-1.3B's move 1.66× the traced bytes and a Llama's 1.13×.

`autocast_bytes(graph)` propagates autocast's dtype along the graph's data flow and returns, per
node but views, the activation bytes it moves under autocast and its cast kernels: a vector op's
reads and writes (0 bytes and no kernel for a cast to the dtype a tensor already has); a GEMM's or
attention's, the casts of its inputs it needs first, kernels of their own. Rules, forward:
- a parameter is fp32 (a GEMM reads its 16-bit cast, which `weight_passes` prices); a floating input
  is fp32; a buffer keeps its traced dtype (models cast their tables, such as rotary cos/sin, to
  the activations' dtype, which the trace cannot see); a view has its base's dtype;
- a GEMM or attention writes 16 bits; each fp32 activation it reads is cast first (read 4 B, write
  2 B an element; once per GEMM: autocast caches only the weights' casts);
- the ops autocast runs in fp32 (norms, softmax, the loss, `sum`, `pow`...) write fp32, and cast a
  16-bit input up first (autocast does not reach backward, which runs outside it);
- a cast the model makes to the compute dtype restores the dtype its value had before the model
  cast it up (RMSNorm's `x.float() ... .type_as(x)`), else casts to 16 bits; a cast to the dtype a
  tensor already has is no kernel;
- any other op writes the widest floating dtype it reads (type promotion).
Backward:
- the input gradient of a GEMM whose forward input was cast is cast back to fp32 (autograd's
  backward of the cast);
- a backward GEMM reading an fp32 gradient made in backward casts it once (shared by the input- and
  weight-gradient products and the bias's sum of one layer); what it reads from forward is the
  saved 16-bit cast;
- a differentiating kernel (`*_backward*`) writes the dtype of the forward tensor it differentiates
  (its first floating forward argument); a 16-bit gradient it reads for an fp32 one is cast first;
- a cast in backward (autograd's backward of a model's cast up) returns the gradient to the dtype
  the forward cast read: none where that forward cast was none (RMSNorm's `x.float()` on the fp32
  residual); forward and backward casts are paired last in, first out by shape;
- other ops promote, as in forward.
What this leaves out: the weight casts and their gradients' casts (`weight_passes`); a model's own
casts whose target depends on its inputs in other ways; the cast back of attention's or a batched
product's cast input; tensor parallelism's way of casting a block's input once before it is
sharded (`runtime/tensor_parallel/autocast.py`: priced here as each projection's cast). Checked against the fake-tensor count
on the zoo's models (`tests/test_autocast_bytes.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.cost_models.tp_shards import op_packet
from autopar.graph.ir import DTYPE_BYTES, OpGraph, OpNode, TensorMeta

FLOATING = {"float32", "bfloat16", "float16", "float64"}
CAST_BYTES = 4 + 2  # read an fp32 element, write its 16-bit copy (or the reverse)
# ops CUDA autocast runs in fp32 (torch's autocast fp32 list, as ATen names them)
FP32_OPS = {"native_layer_norm", "layer_norm", "native_group_norm", "group_norm", "_softmax", "softmax",
            "_log_softmax", "log_softmax", "nll_loss_forward", "nll_loss", "nll_loss2d_forward", "mse_loss",
            "binary_cross_entropy_with_logits", "smooth_l1_loss", "l1_loss", "huber_loss", "norm",
            "linalg_vector_norm", "cumsum", "cumprod", "prod", "exp", "expm1", "log", "log1p", "log2", "log10",
            "pow", "rsqrt", "reciprocal", "sum", "softplus", "logsumexp", "erfinv", "_fused_rms_norm", "rms_norm"}
BACKWARD_KERNELS = ("_backward", "_backward_data")


@dataclass(frozen=True)
class AutocastOp:
    """One node under autocast: the activation bytes it moves and its kernels (a GEMM's: its casts)."""

    moved_bytes: float
    kernels: int


@dataclass
class _Propagation:
    """The dtypes known so far, and what earlier nodes leave for later ones."""

    graph: OpGraph
    low: str  # the 16-bit compute dtype
    producer: dict[str, OpNode] = field(default_factory=dict)
    dtypes: dict[str, list[str]] = field(default_factory=dict)  # node -> autocast dtype of each output
    cast_modules: set[str] = field(default_factory=set)  # modules whose forward GEMM cast an fp32 activation
    # gradients cast to 16 bits for a backward GEMM -> its module, whose other ops read the cast (a bias's sum)
    cast_gradients: dict[str, str] = field(default_factory=dict)
    upcasts: list[tuple[tuple[int, ...], str]] = field(default_factory=list)  # forward casts up: (shape, dtype read)

    def dtype_of(self, name: str, meta: TensorMeta) -> str:
        """The autocast dtype of the input `name` (a producer node, placeholder or view) described by `meta`."""
        if meta.dtype not in FLOATING:
            return meta.dtype
        if name.startswith("param:"):
            return "float32"
        if name.startswith("buffer:"):
            return meta.dtype  # tables models cast to their activations' dtype (rotary cos/sin)
        if name.startswith("input:") or name not in self.dtypes:
            return "float32" if meta.dtype == self.low else meta.dtype
        node = self.producer[name]
        for traced, autocast in zip(node.output_meta, self.dtypes[name]):  # the output this meta describes
            if traced.dtype == meta.dtype and tuple(traced.shape) == tuple(meta.shape):
                return autocast
        return next((autocast for traced, autocast in zip(node.output_meta, self.dtypes[name])
                     if traced.dtype == meta.dtype), meta.dtype)

    def read_by(self, node: OpNode, name: str, meta: TensorMeta) -> str:
        """`dtype_of`, but an op of the module whose backward GEMM cast this gradient reads the cast."""
        dtype = self.dtype_of(name, meta)
        if node.phase == "backward" and dtype == "float32" and not node.is_view and node.module_path \
                and self.cast_gradients.get(self.root(name)) == node.module_path:
            return self.low
        return dtype

    def root(self, name: str) -> str:
        while name in self.producer and self.producer[name].is_view and self.producer[name].input_names:
            name = self.producer[name].input_names[0]
        return name

    def made_in(self, name: str, phase: str) -> bool:
        base = self.root(name)
        return base in self.producer and self.producer[base].phase == phase


def autocast_bytes(graph: OpGraph) -> dict[str, AutocastOp]:
    """Per node but views: what it moves under autocast, for the whole traced batch, parameters' own
    reads excluded (see the module docstring). Empty for an fp32 trace."""
    if graph.precision == "fp32":
        return {}
    return _propagate(graph)[1]


def _propagate(graph: OpGraph) -> tuple[_Propagation, dict[str, AutocastOp]]:
    state = _Propagation(graph, "bfloat16" if graph.precision == "bf16" else "float16",
                         producer={node.name: node for node in graph.nodes})
    result: dict[str, AutocastOp] = {}
    for node in graph.nodes:
        inputs = [(name, meta, state.read_by(node, name, meta)) for name, meta in zip(node.input_names, node.input_meta)]
        if node.is_view:
            state.dtypes[node.name] = [inputs[0][2] if inputs else m.dtype for m in node.output_meta]
        elif node.flops:  # GEMMs, attention, grouped and convolution products
            state.dtypes[node.name], result[node.name] = _product(state, node, inputs)
        else:
            state.dtypes[node.name], result[node.name] = _vector(state, node, inputs)
    return state, result


def autocast_saved_bytes(graph: OpGraph) -> dict[str, float]:
    return autocast_activations(graph)[0]


def autocast_activations(graph: OpGraph) -> tuple[dict[str, float], dict[str, list[str]]]:
    """Per forward node, the bytes it keeps for backward under autocast, for the whole traced batch (the
    trace's own count is `OpNode.saved_bytes`). What backward reads, as the trace marks it
    (`graph.convert._mark_saved`), at autocast's dtypes:
    - a forward output at its autocast dtype, counted once; a cast to the dtype a tensor already has
      (RMSNorm's `x.float()` of the fp32 residual, its `type_as` back) is that tensor, not a copy, and
      is charged to that cast, in the reader's unit, as the trace charges it;
    - what a backward GEMM reads of an fp32 activation is the 16-bit cast its module's forward GEMM
      made: one copy per module (autocast caches only the weights' casts), so separate q, k and v
      projections keep three casts of their block's input where the trace keeps one tensor.
    `autocast_activations` also returns each node's output dtypes under autocast (a unit's input, the
    residual, is fp32 there). Both empty for an fp32 trace."""
    if graph.precision == "fp32":
        return {}, {}
    state, _ = _propagate(graph)
    alias = {node.name: node.input_names[0] for node in graph.nodes
             if op_packet(node) == "_to_copy" and node.input_names and node.output_meta
             and state.dtype_of(node.input_names[0], node.input_meta[0]) == state.dtypes[node.name][0]}

    def resolved(name: str) -> tuple[str, str]:
        """(the node the trace charges a read to, the tensor it is under autocast): a cast that is
        no copy resolves to its source, and is charged where the trace charged it (the reader's unit)."""
        charged = name = state.root(name)
        while name in alias:
            name = state.root(alias[name])
        return charged, name

    kept: dict[tuple, tuple[str, float]] = {}  # what stays alive -> (the forward node it is charged to, bytes)
    for node in graph.nodes:
        if node.phase != "backward":
            continue
        taken: set[tuple[str, int]] = set()  # outputs this node reads already (LayerNorm's mean and rstd)
        for name, meta in zip(node.input_names, node.input_meta):
            charged, base = resolved(name)
            if base not in state.producer or state.producer[base].phase != "forward":
                continue
            if node.flops and meta.dtype in FLOATING and meta.dtype != "float32" and meta.numel > 1 \
                    and state.dtype_of(name, meta) == "float32":
                kept.setdefault((base, node.module_path, tuple(meta.shape)), (charged, meta.numel * _width(state.low)))
                continue
            index = _output_index(state.producer[base], meta, {i for b, i in taken if b == base})
            taken.add((base, index))
            produced = state.producer[base].output_meta[index]
            kept.setdefault((base, index), (charged, produced.numel * _width(state.dtypes[base][index])))
    saved: dict[str, float] = {}
    for base, size in kept.values():
        saved[base] = saved.get(base, 0.0) + size
    return saved, state.dtypes


def _output_index(node: OpNode, meta: TensorMeta, taken: set[int] = frozenset()) -> int:
    """Which output of `node` a reader's `meta` describes, among those it has not matched yet (`taken`):
    same dtype and shape, else same shape, else the first (a view or a cast in between changed them)."""
    for match in (lambda m: m.dtype == meta.dtype and tuple(m.shape) == tuple(meta.shape),
                  lambda m: tuple(m.shape) == tuple(meta.shape)):
        for index, produced in enumerate(node.output_meta):
            if index not in taken and match(produced):
                return index
    return 0


def autocast_activation_factor(graph: OpGraph) -> float | None:
    """Bytes kept for backward under autocast per byte the 16-bit trace keeps, over the repeated layers
    (over the whole graph where it has none); None for an fp32 trace or a graph that keeps nothing.
    The zoo GPT's 1.25 and Llama's 1.04 (`tests/test_autocast_bytes.py`)."""
    if graph.precision == "fp32":
        return None
    saved = autocast_saved_bytes(graph)
    layered = [node for node in graph.nodes if node.layer is not None]
    nodes = layered if any(node.saved_bytes for node in layered) else graph.nodes
    traced = sum(node.saved_bytes for node in nodes)
    return sum(saved.get(node.name, 0.0) for node in nodes) / traced if traced else None


def _width(dtype: str) -> int:
    return DTYPE_BYTES.get(dtype, 4)


def _product(state: _Propagation, node: OpNode, inputs) -> tuple[list[str], AutocastOp]:
    """A GEMM's or attention's output dtypes, and the casts its inputs need."""
    low = state.low
    outputs = [low if m.dtype in FLOATING and m.dtype != "float32" else m.dtype for m in node.output_meta]
    cast_bytes, casts = 0.0, 0
    for name, meta, dtype in inputs:
        base = state.root(name)
        if base.startswith("param:") or dtype != "float32" or meta.numel <= 1:
            continue
        if node.phase == "forward":
            cast_bytes, casts = cast_bytes + meta.numel * CAST_BYTES, casts + 1
            state.cast_modules.add(node.module_path)
        elif state.made_in(base, "backward") and base not in state.cast_gradients:
            state.cast_gradients[base] = node.module_path
            cast_bytes, casts = cast_bytes + meta.numel * CAST_BYTES, casts + 1
    reads_weight = any(state.root(name).startswith("param:") for name in node.input_names)
    if node.phase == "backward" and reads_weight and node.module_path in state.cast_modules and outputs:
        outputs[0] = "float32"  # the input gradient, cast back to the fp32 activation's dtype
        cast_bytes, casts = cast_bytes + node.output_meta[0].numel * CAST_BYTES, casts + 1
    return outputs, AutocastOp(cast_bytes, casts)


def _vector(state: _Propagation, node: OpNode, inputs) -> tuple[list[str], AutocastOp]:
    """A non-product op's output dtypes and the bytes it moves (reads, writes and any casts it needs)."""
    packet = op_packet(node)
    outputs = _vector_outputs(state, node, packet, inputs)
    read_bytes = sum(meta.numel * _width(dtype) for name, meta, dtype in inputs
                     if not state.root(name).startswith("param:"))
    written_bytes = sum(meta.numel * _width(dtype) for meta, dtype in zip(node.output_meta, outputs))
    if packet == "_to_copy" and inputs and outputs and inputs[0][2] == outputs[0]:
        return outputs, AutocastOp(0.0, 0)  # `.to()` a dtype the tensor has: no kernel
    floating = [(name, meta, dtype) for name, meta, dtype in inputs if dtype in FLOATING and meta.shape]
    cast_bytes = 0.0
    if node.phase == "forward" and packet in FP32_OPS:  # autocast casts a 16-bit input up first
        cast_bytes = sum(meta.numel * CAST_BYTES for name, meta, dtype in floating
                         if _width(dtype) < 4 and not state.root(name).startswith("param:"))
        read_bytes += sum(meta.numel * (4 - _width(dtype)) for name, meta, dtype in floating
                          if _width(dtype) < 4 and not state.root(name).startswith("param:"))
    if node.phase == "backward" and packet.endswith(BACKWARD_KERNELS) and outputs and floating:
        name, meta, dtype = floating[0]  # a 16-bit gradient read for an fp32 one is cast back first
        if _width(dtype) < _width(outputs[0]):
            cast_bytes += meta.numel * CAST_BYTES
            read_bytes += meta.numel * (_width(outputs[0]) - _width(dtype))
    return outputs, AutocastOp(read_bytes + written_bytes + cast_bytes, 1)


def _vector_outputs(state: _Propagation, node: OpNode, packet: str, inputs) -> list[str]:
    """Autocast dtype of each output of a non-product op (see the module docstring's rules)."""
    low = state.low
    widest = max((dtype for name, meta, dtype in inputs if dtype in FLOATING and meta.shape), key=_width,
                 default=None)
    if node.phase == "forward" and packet in FP32_OPS:
        widest = "float32"
    elif packet == "_to_copy" and node.output_meta and node.input_meta:
        widest = _cast_target(state, node, inputs)
    elif node.phase == "backward" and packet.endswith(BACKWARD_KERNELS):
        forward = [dtype for name, meta, dtype in inputs
                   if dtype in FLOATING and meta.shape and state.made_in(name, "forward")]
        if forward:
            widest = forward[0]
        elif packet == "embedding_dense_backward":
            widest = "float32"  # the gradient of an fp32 weight
    return [(widest or "float32") if m.dtype == low else m.dtype for m in node.output_meta]


def _cast_target(state: _Propagation, node: OpNode, inputs) -> str | None:
    """What a model's cast writes under autocast. Up to fp32: fp32 (the dtype it read is kept, for
    its backward). Down to the compute dtype: in forward, the dtype the value had before the model
    cast it up; in backward, the dtype its forward cast up read."""
    low, traced_to, traced_from = state.low, node.output_meta[0].dtype, node.input_meta[0].dtype
    if traced_to != low:
        if node.phase == "forward" and traced_from == low:
            state.upcasts.append((tuple(node.input_meta[0].shape), inputs[0][2]))
        return traced_to if traced_to in FLOATING else None
    if node.phase == "forward":
        return _restored(state, node)
    shape = tuple(node.output_meta[0].shape)
    for index in range(len(state.upcasts) - 1, -1, -1):  # last in, first out, by shape
        if state.upcasts[index][0] == shape:
            return state.upcasts.pop(index)[1]
    return low


def _restored(state: _Propagation, node: OpNode, depth: int = 32) -> str:
    """The dtype a model's cast back to the compute dtype restores: that of the value the model cast
    up to fp32 upstream (the nearest such cast within `depth` ops), else 16 bits."""
    frontier, seen = [node.input_names[0]] if node.input_names else [], set()
    while frontier and depth > 0:
        depth -= 1
        name = state.root(frontier.pop(0))
        if name in seen or name not in state.producer:
            continue
        seen.add(name)
        up = state.producer[name]
        if op_packet(up) == "_to_copy" and up.input_meta and up.input_meta[0].dtype == state.low:
            return state.dtype_of(up.input_names[0], up.input_meta[0])
        frontier += [n for n, m in zip(up.input_names, up.input_meta) if m.dtype in FLOATING]
    return state.low
