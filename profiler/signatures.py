"""Operator signatures: what a measured time is keyed by, and the sharded shapes the searcher will ask for.

Why signatures: a model's layers repeat, so its op graph has thousands of nodes but only tens of
distinct (op, input and output shapes and dtypes, scalar arguments). Profiling each distinct one
once covers the whole graph, and the count does not grow with depth.

The IR records tensor shapes and dtypes but not an op's non-tensor arguments (a reduction's dims,
eps, is_causal, ...). `infer_scalars` rebuilds the ones that change the work from the shapes and
assumes the rest (each rule below says which). They are part of the key, so an IR that one day
records them (an `OpNode.scalar_args` dict is picked up if present) adds keys, never corrupts old ones.
Inputs are timed contiguous: the IR has no strides, so a transposed weight feeding a matmul is
timed as a plain matrix (cuBLAS reads either layout at the same speed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from pydantic import BaseModel, ConfigDict, field_validator

from autopar.graph.ir import OpGraph, OpNode, TensorMeta

MATMUL_OPS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default"})
ATTENTION_OPS = frozenset({
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_backward.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_efficient_attention_backward.default",
})
_ALLOCATION_ONLY = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
DEFAULT_TP_DEGREES = (2, 4, 8)
DEFAULT_MICROBATCHES = (1, 2, 4)


def _freeze(value: Any) -> Any:
    """Lists become tuples so that a signature is hashable and compares by value."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def op_packet(op: str) -> str:
    """"aten.mm.default" -> "mm"; the overload-free name the rules below are keyed by."""
    parts = op.split(".")
    return parts[-2] if len(parts) >= 3 else parts[-1]


def _tensor_text(meta: TensorMeta) -> str:
    return f"{meta.dtype}[{','.join(str(s) for s in meta.shape)}]"


class OpSignature(BaseModel):
    """One distinct operator call: enough to rebuild its inputs and run it again."""

    model_config = ConfigDict(frozen=True)

    op: str  # e.g. "aten.mm.default"
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...] = ()
    scalars: tuple[tuple[str, Any], ...] = ()  # sorted (name, value) pairs of non-tensor arguments

    @field_validator("scalars", mode="before")
    @classmethod
    def _sorted_frozen(cls, value: Any) -> Any:
        items = value.items() if isinstance(value, dict) else value
        return tuple(sorted((str(k), _freeze(v)) for k, v in items))

    @property
    def key(self) -> str:
        """The database key: readable, and identical for identical calls."""
        ins = ",".join(_tensor_text(m) for m in self.inputs)
        outs = ",".join(_tensor_text(m) for m in self.outputs)
        scalars = ",".join(f"{k}={v!r}" for k, v in self.scalars)
        return f"{self.op}({ins})->({outs}){{{scalars}}}"

    @property
    def packet(self) -> str:
        return op_packet(self.op)

    def scalar_dict(self) -> dict[str, Any]:
        return dict(self.scalars)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of all inputs and outputs: the memory a run needs at the least."""
        return sum(m.bytes for m in self.inputs) + sum(m.bytes for m in self.outputs)


# --- scalar arguments the IR does not record ---------------------------------------------------
def _reduced_dims(inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta]) -> dict[str, Any]:
    """Which dims a reduction summed over, read off the input and output shapes."""
    if not inputs or not outputs:
        return {}
    before, after = inputs[0].shape, outputs[0].shape
    if len(after) == len(before):
        dims = tuple(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
        return {"dim": dims or tuple(i for i, b in enumerate(after) if b == 1), "keepdim": True}
    kept, dims = list(after), []  # the output dims are a subsequence of the input's: match greedily
    for i, size in enumerate(before):
        if kept and kept[0] == size:
            kept.pop(0)
        else:
            dims.append(i)
    return {"dim": tuple(dims), "keepdim": False}


def _first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return len(a) - 1


def _norm_dims(inputs: Sequence[TensorMeta], weight_index: int) -> int:
    """LayerNorm normalizes the trailing dims its weight covers; one when it has no weight."""
    if len(inputs) > weight_index and len(inputs[weight_index].shape) >= 1:
        return len(inputs[weight_index].shape)
    return 1


def _scalar_rules() -> dict[str, Any]:
    """Per op (overload-free name): (inputs, outputs) -> the scalar arguments to pass."""
    softmax = lambda i, o: {"dim": -1, "half_to_float": i[0].dtype != o[0].dtype}  # assumes the last dim
    softmax_bwd = lambda i, o: {"dim": -1, "input_dtype": o[0].dtype}
    nll = lambda i, o: {"reduction": 1, "ignore_index": -100}  # mean, torch's default ignore index
    flash_causal = True  # the IR drops is_causal; decoder LMs (every zoo model) are causal
    return {
        "_softmax": softmax, "_log_softmax": softmax,
        "_softmax_backward_data": softmax_bwd, "_log_softmax_backward_data": softmax_bwd,
        **{name: _reduced_dims for name in ("sum", "mean", "amax", "amin", "var", "std", "var_mean", "prod")},
        "cat": lambda i, o: {"dim": _first_difference(i[0].shape, o[0].shape)} if i and o else {},
        "native_layer_norm": lambda i, o: {
            "normalized_shape": i[0].shape[len(i[0].shape) - _norm_dims(i, 1):], "eps": 1e-5},
        "native_layer_norm_backward": lambda i, o: {
            "normalized_shape": i[1].shape[len(i[1].shape) - _norm_dims(i, 4):],
            "output_mask": (True, len(i) >= 5, len(i) >= 6)},
        "slice_backward": lambda i, o: _slice_backward(i[0].shape, o[0].shape),
        "embedding_dense_backward": lambda i, o: {
            "num_weights": o[0].shape[0], "padding_idx": -1, "scale_grad_by_freq": False},
        "nll_loss_forward": nll, "nll_loss_backward": nll,
        "_to_copy": lambda i, o: {"dtype": o[0].dtype},
        "arange": lambda i, o: {"end": o[0].numel, "dtype": o[0].dtype},
        **{name: (lambda i, o: {"size": o[0].shape, "dtype": o[0].dtype}) for name in ("zeros", "ones", "full")},
        **{name: (lambda i, o: {"size": o[0].shape}) for name in ("new_zeros", "new_ones", "new_full")},
        "native_dropout": lambda i, o: {"p": 0.1, "train": True},  # the IR drops p; 0.1 is a guess
        "native_dropout_backward": lambda i, o: {"scale": 1 / 0.9},
        "_scaled_dot_product_flash_attention": lambda i, o: {
            "dropout_p": 0.0, "is_causal": flash_causal, "return_debug_mask": False},
        "_scaled_dot_product_flash_attention_backward": lambda i, o: {
            "cum_seq_q": None, "cum_seq_k": None, "max_q": i[1].shape[-2], "max_k": i[2].shape[-2],
            "dropout_p": 0.0, "is_causal": flash_causal},
        # With a mask the mask carries causality (capture passes is_causal=False with it).
        "_scaled_dot_product_efficient_attention": lambda i, o: {
            "compute_log_sumexp": True, "dropout_p": 0.0, "is_causal": len(i) < 4,
            **({"attn_bias": None} if len(i) < 4 else {})},
        "_scaled_dot_product_efficient_attention_backward": lambda i, o: {
            "dropout_p": 0.0, "grad_input_mask": (True, True, True, False), "is_causal": len(i) < 9,
            **({"attn_bias": None} if len(i) < 9 else {})},
    }


def _slice_backward(grad: tuple[int, ...], full: tuple[int, ...]) -> dict[str, Any]:
    dim = _first_difference(grad, full)
    return {"input_sizes": full, "dim": dim, "start": 0, "end": grad[dim], "step": 1}


_RULES = _scalar_rules()


def infer_scalars(op: str, inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta]) -> dict[str, Any]:
    """The non-tensor arguments of `op` that change its work, rebuilt from shapes where possible."""
    rule = _RULES.get(op_packet(op))
    try:
        return dict(rule(list(inputs), list(outputs))) if rule else {}
    except (IndexError, ValueError):  # an unusual arity: leave it to the harness to report
        return {}


# --- nodes -> signatures ---------------------------------------------------------------------------
def needs_profile(node: OpNode) -> bool:
    """Views move no data and allocation-only ops do no work: nothing to time."""
    if node.is_view or op_packet(node.op) in _ALLOCATION_ONLY:
        return False
    return bool(node.flops or node.vector_flops or node.bytes_read or node.bytes_written)


def signature_of(node: OpNode) -> OpSignature:
    scalars = infer_scalars(node.op, node.input_meta, node.output_meta)
    scalars.update(getattr(node, "scalar_args", None) or {})  # recorded arguments win over inferred
    return OpSignature(op=node.op, inputs=tuple(node.input_meta), outputs=tuple(node.output_meta), scalars=scalars)


def unique_signatures(nodes: Iterable[OpNode]) -> list[OpSignature]:
    """Distinct signatures of the nodes that need profiling, in first-seen order."""
    return list(dict.fromkeys(signature_of(n) for n in nodes if needs_profile(n)))


# --- sharded variants ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardedVariant:
    """A signature as one rank sees it under tensor parallelism `tp` and micro-batch size `microbatch`."""

    signature: OpSignature
    tp: int
    tp_dim: str | None  # which dim tp divides: "M", "K", "N" (mm), "B" (bmm), "heads" (attention)
    microbatch: int | None  # None: the traced batch
    token_dim: str | None = None  # the mm dim read as tokens when that was ambiguous (see `token_dims`)


def _matmul_dims(sig: OpSignature) -> dict[str, int] | None:
    """mm/addmm: C[M,N] = A[M,K]·B[K,N]; bmm/baddbmm add a leading batch dim B."""
    shapes = [m.shape for m in sig.inputs]
    name = sig.packet
    if name in ("mm", "bmm") and len(shapes) == 2:
        a, b = shapes
    elif name in ("addmm", "baddbmm") and len(shapes) == 3:
        a, b = shapes[1], shapes[2]
    else:
        return None
    rank = 3 if name in ("bmm", "baddbmm") else 2
    if len(a) != rank or len(b) != rank:
        return None
    dims = {"M": a[-2], "K": a[-1], "N": b[-1]}
    if rank == 3:
        dims["B"] = a[0]
    return dims


def token_dims(sig: OpSignature, *, batch: int, seq_len: int | None) -> tuple[str, ...]:
    """The mm/addmm dims that may hold the batch·seq tokens: M in forward and input-gradient
    matmuls, K in weight-gradient ones (tokens are contracted). Every one of M, K, N equal to
    batch·seq, in that order; more than one when a width happens to equal the token count."""
    dims = _matmul_dims(sig)
    if dims is None or "B" in dims or not seq_len:
        return ()
    return tuple(name for name in ("M", "K", "N") if dims[name] == batch * seq_len)


def _token_dim(sig: OpSignature, batch: int, seq_len: int | None, token_dim: str | None) -> str | None:
    candidates = token_dims(sig, batch=batch, seq_len=seq_len)
    if token_dim is not None:
        if token_dim not in candidates:
            raise ValueError(f"{sig.op}: token_dim {token_dim!r} is not of size batch·seq; candidates {candidates}")
        return token_dim
    return candidates[0] if candidates else None


def tp_dims(sig: OpSignature, *, batch: int, seq_len: int | None, token_dim: str | None = None) -> tuple[str, ...]:
    """The dims tensor parallelism may divide for this op (empty: not a matmul-class op).

    mm/addmm: every dim but the token dim, since TP splits weights, not tokens. For a Linear with
    weight [out, in]: forward A[T,in]·Wᵀ → column-parallel divides N (=out), row-parallel K (=in);
    input gradient G[T,out]·W → column K, row N; weight gradient Gᵀ[out,T]·X → column M, row N.
    Without a token dim (unknown seq_len) only K and N. bmm/baddbmm: the leading batch·heads dim
    (heads are split). Attention: the heads dim. `token_dim` settles an ambiguous token dim.
    """
    if sig.op in ATTENTION_OPS:
        return ("heads",)
    dims = _matmul_dims(sig)
    if dims is None:
        return ()
    if "B" in dims:
        return ("B",)
    token = _token_dim(sig, batch, seq_len, token_dim)
    return tuple(d for d in ("M", "K", "N") if d != token) if token else ("K", "N")


def _rescale(shape: tuple[int, ...], old: tuple[int, ...], new: tuple[int, ...]) -> tuple[int, ...]:
    """A broadcast operand (addmm's bias) follows the output dims it lines up with from the right."""
    result = list(shape)
    for offset in range(1, min(len(shape), len(old)) + 1):
        if shape[-offset] != 1 and shape[-offset] == old[-offset]:
            result[-offset] = new[-offset]
    return tuple(result)


def _matmul_with(sig: OpSignature, old: dict[str, int], new: dict[str, int]) -> OpSignature:
    lead_old = (old["B"],) if "B" in old else ()
    lead_new = (new["B"],) if "B" in new else ()
    a, b = sig.inputs[-2], sig.inputs[-1]
    inputs = [TensorMeta(shape=(*lead_new, new["M"], new["K"]), dtype=a.dtype),
              TensorMeta(shape=(*lead_new, new["K"], new["N"]), dtype=b.dtype)]
    if len(sig.inputs) == 3:
        bias = sig.inputs[0]
        shape = _rescale(bias.shape, (*lead_old, old["M"], old["N"]), (*lead_new, new["M"], new["N"]))
        inputs.insert(0, TensorMeta(shape=shape, dtype=bias.dtype))
    out_dtype = sig.outputs[0].dtype if sig.outputs else a.dtype
    output = TensorMeta(shape=(*lead_new, new["M"], new["N"]), dtype=out_dtype)
    return OpSignature(op=sig.op, inputs=tuple(inputs), outputs=(output,), scalars=sig.scalars)


def _attention_with(sig: OpSignature, batch_to: int | None, tp: int) -> OpSignature | None:
    """Every tensor of rank ≥ 3 is [batch, heads, ...]: micro-batch sets dim 0, tp divides dim 1."""
    def scaled(meta: TensorMeta) -> TensorMeta | None:
        if len(meta.shape) < 3:
            return meta  # philox seed and offset, the empty debug mask
        shape = list(meta.shape)
        if batch_to is not None:
            shape[0] = batch_to
        if shape[1] % tp:
            return None
        shape[1] //= tp
        return TensorMeta(shape=tuple(shape), dtype=meta.dtype)

    inputs, outputs = [scaled(m) for m in sig.inputs], [scaled(m) for m in sig.outputs]
    if any(m is None for m in inputs + outputs):
        return None
    return OpSignature(op=sig.op, inputs=tuple(inputs), outputs=tuple(outputs), scalars=sig.scalars)


def scale_signature(
    sig: OpSignature, *, batch: int, seq_len: int | None, tp: int = 1, tp_dim: str | None = None,
    microbatch: int | None = None, token_dim: str | None = None,
) -> OpSignature | None:
    """`sig` (traced at `batch` sequences of `seq_len`) as one rank runs it at micro-batch size
    `microbatch` under `tp`-way tensor parallelism along `tp_dim` (see `tp_dims`).

    Micro-batch scaling changes the token dim of mm/addmm (T = batch·seq → microbatch·seq), the
    leading dim of bmm/baddbmm (batch·heads → microbatch·heads) and dim 0 of attention tensors.
    Returns `sig` itself when nothing changes, None when the op is not matmul-class or the sizes do
    not divide; raises ValueError for a `tp_dim` the op does not have. `token_dim` ("M", "K" or
    "N") names the token dim where more than one matmul dim equals batch·seq (default: the first).
    """
    rescale_batch = microbatch is not None and microbatch != batch
    if tp == 1 and not rescale_batch:
        return sig
    allowed = tp_dims(sig, batch=batch, seq_len=seq_len, token_dim=token_dim)
    if not allowed:
        return None
    tp_dim = tp_dim or (allowed[0] if len(allowed) == 1 else None)
    if tp > 1 and tp_dim not in allowed:
        raise ValueError(f"{sig.op}: tp_dim must be one of {', '.join(allowed)}, got {tp_dim!r}")
    if sig.op in ATTENTION_OPS:
        leading = sig.inputs[0].shape[0]
        if rescale_batch and leading % batch:
            return None
        return _attention_with(sig, leading // batch * microbatch if rescale_batch else None, tp)
    dims = _matmul_dims(sig)
    assert dims is not None
    new = dict(dims)
    token = "B" if "B" in dims else _token_dim(sig, batch, seq_len, token_dim)
    if rescale_batch:
        if token is None or dims[token] % batch:
            return None
        new[token] = dims[token] // batch * microbatch
    if tp > 1:
        per_sample = dims["B"] // batch if tp_dim == "B" and dims["B"] % batch == 0 else new[tp_dim]
        if per_sample % tp or new[tp_dim] % tp:
            return None
        new[tp_dim] //= tp
    return _matmul_with(sig, dims, new)


def sharded_variants(
    sig: OpSignature, *, batch: int, seq_len: int | None,
    tp_degrees: Sequence[int] = DEFAULT_TP_DEGREES, microbatches: Sequence[int] = DEFAULT_MICROBATCHES,
) -> list[ShardedVariant]:
    """Every (tp, tp_dim, micro-batch) combination of a matmul-class signature, the traced one
    excluded; under each reading of the token dim when that is ambiguous (see `token_dims`)."""
    variants: dict[OpSignature, ShardedVariant] = {}
    batches = [None] + [m for m in microbatches if m != batch]
    for token in token_dims(sig, batch=batch, seq_len=seq_len) or (None,):
        dims = tp_dims(sig, batch=batch, seq_len=seq_len, token_dim=token)
        choices = [(1, None)] + [(t, d) for t in tp_degrees if t > 1 for d in dims]
        for micro in batches:
            for tp, dim in choices:
                if micro is None and tp == 1:
                    continue
                scaled = scale_signature(sig, batch=batch, seq_len=seq_len, tp=tp, tp_dim=dim, microbatch=micro,
                                         token_dim=token)
                if scaled is not None and scaled != sig and scaled not in variants:
                    variants[scaled] = ShardedVariant(scaled, tp, dim, micro, token)
    return list(variants.values())


def signatures_to_profile(
    graph: OpGraph, *, tp_degrees: Sequence[int] = DEFAULT_TP_DEGREES,
    microbatches: Sequence[int] = DEFAULT_MICROBATCHES,
) -> list[OpSignature]:
    """The graph's own signatures first (what a step runs), then the sharded variants, deduplicated."""
    base = unique_signatures(graph.nodes)
    ordered = dict.fromkeys(base)
    for sig in base:
        for variant in sharded_variants(sig, batch=graph.batch, seq_len=graph.seq_len,
                                        tp_degrees=tp_degrees, microbatches=microbatches):
            ordered.setdefault(variant.signature)
    return list(ordered)
