"""The bytes each op of a 16-bit trace moves when the runtime runs it under autocast over fp32 weights.

The graph is traced with every weight and activation in the compute dtype. autopar's runtime without
ZeRO instead runs `torch.autocast` over fp32 weights (`memory.autocast_states`): GEMMs and attention
cast their inputs to 16 bits and return 16 bits, the norms and the loss run in fp32, and every other
op computes in the widest dtype it reads. So the residual stream stays fp32, an fp32 activation is
cast apart before each GEMM that reads it, and its gradient is cast back. On one H200 these vector
ops took 2.3× what the 16-bit trace priced (README, seventh session); counted on fake tensors
(`benchmarks/autocast_bytes.py`) GPT-1.3B's move 1.66× the traced bytes and a Llama's 1.13×.

`autocast_bytes(graph)` propagates autocast's dtype along the graph's data flow and returns, per
node, the activation bytes it moves under autocast (a vector op's reads and writes; a GEMM's or
attention's: the casts of its inputs it needs first, kernels of their own). Rules, forward:
- a parameter is fp32 (a GEMM reads its 16-bit cast, which `weight_passes` prices); a floating input
  is fp32; a buffer keeps its traced dtype (models cast their tables, such as rotary cos/sin, to
  the activations' dtype, which the trace cannot see); a view has its base's dtype;
- a GEMM or attention writes 16 bits; each fp32 activation it reads is cast first (read 4 B, write
  2 B an element; once per GEMM: autocast caches only the weights' casts);
- the ops autocast runs in fp32 (norms, softmax, the loss) write fp32;
- a cast the model makes to the compute dtype restores the dtype its value had before the model
  cast it up (RMSNorm's `x.float() ... .type_as(x)`), else casts to 16 bits; a cast to the dtype a
  tensor already has is no kernel;
- any other op writes the widest floating dtype it reads (type promotion).
Backward:
- the input gradient of a GEMM whose forward input was cast is cast back to fp32 (autograd's
  backward of the cast);
- a backward GEMM reading an fp32 gradient made in backward casts it once (shared by the input- and
  weight-gradient products of one layer); what it reads from forward is the saved 16-bit cast;
- a differentiating kernel (`*_backward*`) writes the dtype of the forward tensor it differentiates
  (its first floating forward argument); a 16-bit gradient it reads for an fp32 one is cast first;
- other ops promote, as in forward.
What this leaves out: the weight casts and their gradients' casts (`weight_passes`), and a model's
own casts whose target depends on its inputs in other ways. Checked against the fake-tensor count
on the zoo's models (`tests/test_autocast_bytes.py`).
"""

from __future__ import annotations

from autopar.cost_models.tp_shards import op_packet
from autopar.graph.ir import DTYPE_BYTES, OpGraph, OpNode

FLOATING = {"float32", "bfloat16", "float16", "float64"}
CAST_BYTES = 4 + 2  # read an fp32 element, write its 16-bit copy (or the reverse)
# ops CUDA autocast runs in fp32 (torch/csrc/autograd/autocast_mode.cpp's fp32 list, as ATen names them)
FP32_OPS = {"native_layer_norm", "layer_norm", "native_group_norm", "group_norm", "_softmax", "softmax",
            "_log_softmax", "log_softmax", "nll_loss_forward", "nll_loss", "nll_loss2d_forward", "mse_loss",
            "binary_cross_entropy_with_logits", "smooth_l1_loss", "l1_loss", "huber_loss", "norm",
            "linalg_vector_norm", "cumsum", "cumprod", "prod", "exp", "log", "pow", "rsqrt", "reciprocal",
            "_fused_rms_norm", "rms_norm"}
_WIDTH = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def autocast_bytes(graph: OpGraph) -> dict[str, float]:
    """Per node (views and ops on non-floating tensors omitted): activation bytes moved under autocast,
    for the whole traced batch, parameters' own reads excluded (see the module docstring)."""
    if graph.precision == "fp32":
        return {}
    low = "bfloat16" if graph.precision == "bf16" else "float16"
    dtype: dict[str, list[str]] = {}  # node -> autocast dtype of each output
    producer = {node.name: node for node in graph.nodes}
    cast_modules: set[str] = set()  # modules whose forward GEMM cast an fp32 activation
    cast_in_backward: set[str] = set()  # gradients already cast to 16 bits for a backward GEMM
    moved: dict[str, float] = {}

    def of(name: str, meta) -> str:
        if name.startswith("param:"):
            return "float32" if meta.dtype in FLOATING else meta.dtype
        if name.startswith("buffer:"):
            return meta.dtype  # tables models cast to their activations' dtype (rotary cos/sin)
        if name.startswith("input:") or name not in dtype:
            return "float32" if meta.dtype == low else meta.dtype
        outputs = dtype[name]
        return outputs[0] if outputs else meta.dtype

    def root(name: str) -> str:
        while name in producer and producer[name].is_view and producer[name].input_names:
            name = producer[name].input_names[0]
        return name

    for node in graph.nodes:
        packet = op_packet(node)
        inputs = [(name, meta, of(name, meta)) for name, meta in zip(node.input_names, node.input_meta)]
        floating = [(name, meta, kind) for name, meta, kind in inputs if kind in FLOATING]
        if node.is_view:
            dtype[node.name] = [inputs[0][2] if inputs else m.dtype for m in node.output_meta]
            continue
        if node.flops:  # GEMMs, attention, grouped and convolution products
            dtype[node.name], moved[node.name] = _gemm(node, floating, low, root, producer, cast_modules,
                                                       cast_in_backward)
            continue
        outputs = _vector_outputs(node, packet, inputs, floating, low, producer, dtype, root)
        dtype[node.name] = outputs
        read = sum(meta.numel * _WIDTH.get(kind, DTYPE_BYTES.get(kind, 4))
                   for name, meta, kind in inputs if not name.startswith("param:"))
        written = sum(meta.numel * _WIDTH.get(kind, DTYPE_BYTES.get(kind, 4))
                      for meta, kind in zip(node.output_meta, outputs))
        if packet == "_to_copy" and inputs and outputs and inputs[0][2] == outputs[0]:
            read = written = 0.0  # `.to()` a dtype the tensor has: no kernel
        extra = 0.0
        if node.phase == "backward" and packet.endswith(("_backward", "_backward_data")) and outputs:
            target = outputs[0]  # a 16-bit gradient read for an fp32 one is cast back first
            for name, meta, kind in floating[:1]:
                if kind != target and _WIDTH.get(kind, 4) < _WIDTH.get(target, 4):
                    extra += meta.numel * CAST_BYTES
                    read += meta.numel * (_WIDTH[target] - _WIDTH.get(kind, 4))
        moved[node.name] = read + written + extra
    return moved


def _gemm(node: OpNode, floating, low: str, root, producer, cast_modules: set[str], cast_in_backward: set[str]
          ) -> tuple[list[str], float]:
    """A GEMM's or attention's output dtypes and the bytes of the casts its inputs need."""
    outputs = [low if m.dtype in FLOATING and m.dtype != "float32" else m.dtype for m in node.output_meta]
    cast = 0.0
    for name, meta, kind in floating:
        base = root(name)
        if base.startswith("param:") or kind != "float32" or meta.numel <= 1:
            continue
        if node.phase == "forward":
            cast += meta.numel * CAST_BYTES
            cast_modules.add(node.module_path)
        elif base in producer and producer[base].phase == "backward" and base not in cast_in_backward:
            cast_in_backward.add(base)
            cast += meta.numel * CAST_BYTES
    reads_weight = any(root(name).startswith("param:") for name in node.input_names)
    if node.phase == "backward" and reads_weight and node.module_path in cast_modules and outputs:
        outputs[0] = "float32"  # the input gradient, cast back to the fp32 activation's dtype
        cast += node.output_meta[0].numel * CAST_BYTES
    return outputs, cast


def _vector_outputs(node: OpNode, packet: str, inputs, floating, low: str, producer, dtype, root) -> list[str]:
    """Autocast dtype of each output of a non-GEMM op (see the module docstring's rules)."""
    widest = max((kind for name, meta, kind in floating if meta.shape), key=lambda k: _WIDTH.get(k, 4),
                 default=None)
    if packet in FP32_OPS:
        widest = "float32"
    elif packet == "_to_copy" and node.output_meta and node.output_meta[0].dtype == low:
        widest = _restored(node, producer, dtype, root, low) if node.phase == "forward" else low
    elif node.phase == "backward" and packet.endswith(("_backward", "_backward_data")):
        forward = [kind for name, meta, kind in floating
                   if root(name) in producer and producer[root(name)].phase == "forward" and meta.shape]
        if forward:
            widest = forward[0]
        elif packet == "embedding_dense_backward":
            widest = "float32"  # the gradient of an fp32 weight
    return [(widest or "float32") if m.dtype == low else m.dtype for m in node.output_meta]


def _restored(node: OpNode, producer, dtype, root, low: str, depth: int = 32) -> str:
    """The dtype a model's cast back to the compute dtype restores: that of the value the model cast
    up to fp32 upstream (the nearest such cast within `depth` ops), else 16 bits."""
    frontier, seen = [node.input_names[0]] if node.input_names else [], set()
    while frontier and depth > 0:
        depth -= 1
        name = root(frontier.pop(0))
        if name in seen or name not in producer:
            continue
        seen.add(name)
        up = producer[name]
        if op_packet(up) == "_to_copy" and up.input_meta and up.input_meta[0].dtype == low:
            source = up.input_names[0]
            base = root(source)
            if base.startswith(("param:", "input:")) or base not in dtype:
                return "float32"
            return dtype[base][0] if dtype[base] else low
        frontier += [n for n, m in zip(up.input_names, up.input_meta) if m.dtype in FLOATING]
    return low
