"""Sharding strategies of single ATen ops over a 1-D tensor-parallel axis, in DTensor's terms.

A tensor's placement over the `tp` ranks is `R` (every rank holds all of it), `S(d)` (rank i holds
the i-th of `tp` blocks along dim d; see `shardable`) or `P` (every rank holds a full-size partial
sum; R becomes P for free, as in DTensor). A strategy of an op names the placement it needs for
each tensor input (None: any, nothing is read), the placement of each output, and whether the
op's work divides over tp. The candidate sets follow DTensor's op strategies
(torch.distributed.tensor._ops), restated for the shapes the op graph records:

- contractions mm / addmm / bmm / baddbmm with A[.., m, k] @ B[.., k, n]: replicated; column
  (B S(n) → S(n), a bias sharded alike); row (A S(k), B S(k) → P, a bias taken as P); rows
  (A S(m), B R → S(m)); for bmm also batch (A, B S(0) → S(0)); and linearity (one operand P, the
  other R → P, undivided).
- fused attention, forward and backward: replicated, heads (dim 1 of every tensor of rank ≥ 3), or
  batch (dim 0). Smaller tensors (seeds, offsets) stay R.
- embedding: replicated, vocab (weight S(0) → P), hidden (weight S(1) → S(-1)), or any index dim;
  its dense backward likewise (hidden, index dims → P, vocab → S(0)).
- layer / RMS norm: any dim except the normalized ones (found where the saved mean or rstd has
  size 1); the backward's weight and bias gradients become P.
- softmax and log-softmax (and their backward): any dim but the last (the graph keeps no dim
  argument; the models softmax over the last dim), or the last with its row statistics
  all-reduced inside the op (vocab-parallel). nll_loss: replicated, rows → P, or vocab → P.
- everything else is treated as pointwise with broadcasting and reductions: `S(d)` for each output
  dim d on which every input either agrees in size (then sharded alike) or broadcasts (then R);
  sum and mean also turn an input sharded on a reduced dim into P; linear ops (add/sub of tensors,
  mul/div by a replicated tensor, casts, copies, cat, sums, slice/select backward) pass P on.
  Ops whose result depends on positions along a dim (sort, cumsum, gather, index, convolution,
  batch norm, ...) are offered replicated only.
- creation ops (arange, ones_like, ...) may create any shardable block locally.

View ops carry no strategy: `view_dim_map` says where each sharded input dim goes (None where the
view splits a shard unevenly or mixes it with other dims, which forces a gather first);
`trace_views` and `through_views` carry a placement along a chain of views. `gradient_tensors`
finds which backward output is each parameter's gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.graph.ir import OpNode

R, P = "R", "P"


def S(dim: int) -> str:
    return f"S({dim})"


def shard_dim(placement: str | None) -> int | None:
    return int(placement[2:-1]) if placement and placement.startswith("S(") else None


@dataclass(frozen=True)
class Strategy:
    name: str
    inputs: tuple[str | None, ...]  # per entry of node.input_meta
    outputs: tuple[str, ...]  # per entry of node.output_meta
    divided: bool  # the op's work divides over tp
    collectives: tuple[tuple[str, int], ...] = ()  # inside the op: (kind, bytes at the traced batch)

    def describe(self) -> str:
        return f"{self.name}[{','.join(p or '*' for p in self.inputs)}->{','.join(self.outputs)}]"


_CONTRACTIONS = {"mm": (None, 0, 1), "addmm": (0, 1, 2), "bmm": (None, 0, 1), "baddbmm": (0, 1, 2)}
_ATTENTION_MARKERS = ("scaled_dot_product", "flash_attention", "efficient_attention")
_SOFTMAX = {"_softmax", "_log_softmax", "softmax", "log_softmax", "_softmax_backward_data",
            "_log_softmax_backward_data"}
_CREATION = {"arange", "ones_like", "zeros_like", "empty_like", "full_like", "rand_like", "randn_like", "zeros",
             "ones", "full", "empty", "scalar_tensor", "new_zeros", "new_ones", "new_empty", "new_full"}
_POSITIONAL = {"sort", "argsort", "topk", "cumsum", "cumprod", "gather", "scatter", "scatter_add", "index",
               "index_put", "index_select", "index_add", "masked_select", "nonzero", "unique", "roll", "flip",
               "tril", "triu", "repeat_interleave", "batch_norm", "native_batch_norm", "native_group_norm",
               "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "convolution",
               "convolution_backward", "native_batch_norm_backward", "native_group_norm_backward", "_unique2",
               "max_pool2d_with_indices", "avg_pool2d", "upsample_nearest2d", "constant_pad_nd", "pad"}
_LINEAR_UNARY = {"neg", "clone", "_to_copy", "copy", "sum", "mean", "cat", "slice_backward", "select_backward",
                 "expand", "contiguous", "alias", "squeeze", "unsqueeze", "stack", "lift_fresh_copy"}
_REDUCTIONS_TO_PARTIAL = {"sum", "mean"}
_PERMUTING_VIEWS = {"t", "transpose", "permute", "swapaxes", "movedim", "numpy_T"}


def shardable(size: int, tp: int) -> bool:
    """A dim can be split over tp evenly, or unevenly (torch.chunk blocks, as DTensor allows) when
    the imbalance is under 1/32, e.g. a 50,257-word vocabulary over 8 ranks."""
    return size >= tp and (size % tp == 0 or size >= 32 * tp)


def packet(op: str) -> str:
    parts = op.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else op


def is_attention(op: str) -> bool:
    return any(marker in op for marker in _ATTENTION_MARKERS)


def op_strategies(node: OpNode, tp: int) -> list[Strategy]:
    """The candidate strategies of a non-view op, replicated first; duplicates dropped."""
    kind = packet(node.op)
    ins = [m.shape for m in node.input_meta]
    outs = [m.shape for m in node.output_meta]
    ok = lambda shape, d: 0 <= d < len(shape) and shardable(shape[d], tp)  # noqa: E731
    found = [Strategy("replicate", tuple(R for _ in ins), tuple(R for _ in outs), False)]
    if tp > 1:
        if kind in _CREATION or not ins:
            found += [Strategy(f"create-S({d})", tuple(None for _ in ins), tuple(S(d) for _ in outs), True)
                      for d in range(len(outs[0]) if outs else 0) if all(ok(o, d) for o in outs)]
        elif kind in _CONTRACTIONS and len(ins) > max(i for i in _CONTRACTIONS[kind] if i is not None):
            found += _contraction(kind, ins, outs, ok)
        elif is_attention(node.op):
            found += _attention(ins, outs, ok)
        elif kind == "embedding" and len(ins) >= 2:
            found += _embedding(ins, outs, ok)
        elif kind == "embedding_dense_backward" and len(ins) >= 2:
            found += _embedding_backward(ins, outs, ok)
        elif "layer_norm" in kind or "rms_norm" in kind:
            found += _norm(kind, ins, outs, ok)
        elif kind in _SOFTMAX:
            found += _pointwise(ins, outs, ok, excluded={len(outs[0]) - 1} if outs else set())
            found += _vocab_softmax(kind, node, ok)
        elif kind.startswith("nll_loss"):
            found += _nll_loss(kind, ins, outs, ok)
        elif kind not in _POSITIONAL:
            found += _pointwise(ins, outs, ok)
            if kind in _REDUCTIONS_TO_PARTIAL and len(ins) == 1 and outs:
                found += _reduce_to_partial(ins[0], outs, ok)
            found += _linear(kind, ins, outs)
    unique: dict[tuple, Strategy] = {}
    for strategy in found:
        unique.setdefault((strategy.inputs, strategy.outputs, strategy.divided), strategy)
    return list(unique.values())


def _contraction(kind, ins, outs, ok) -> list[Strategy]:
    bias, a, b = _CONTRACTIONS[kind]
    off = len(ins[a]) - 2  # 1 for the batched forms
    m, k, n = off, off + 1, off + 1  # A[.., m, k], B[.., k, n] (B's n dim is also off + 1)
    out_rank = len(outs[0])

    def place(a_p, b_p, out_p, bias_p, divided, name):
        inputs = [R] * len(ins)
        inputs[a], inputs[b] = a_p, b_p
        if bias is not None:
            inputs[bias] = bias_p
        return Strategy(name, tuple(inputs), (out_p,) + tuple(R for _ in outs[1:]), divided)

    def bias_like(out_dim):
        if bias is None:
            return R
        shape = ins[bias]
        aligned = out_dim - (out_rank - len(shape))
        return S(aligned) if aligned >= 0 and shape[aligned] == outs[0][out_dim] else R

    result = []
    if ok(ins[b], n) and ok(outs[0], out_rank - 1):
        result.append(place(R, S(n), S(out_rank - 1), bias_like(out_rank - 1), True, "column"))
    if ok(ins[a], k) and ok(ins[b], off):
        result.append(place(S(k), S(off), P, P, True, "row"))
    if ok(ins[a], m) and ok(outs[0], out_rank - 2):
        result.append(place(S(m), R, S(out_rank - 2), bias_like(out_rank - 2), True, "rows"))
    if off and ok(ins[a], 0) and ok(ins[b], 0):
        result.append(place(S(0), S(0), S(0), bias_like(0), True, "batch"))
    if bias is None:
        result += [place(P, R, P, None, False, "linear-a"), place(R, P, P, None, False, "linear-b")]
    return result


def _attention(ins, outs, ok) -> list[Strategy]:
    result = []
    for dim, name in ((1, "heads"), (0, "batch")):
        place = [R if len(s) < 3 or s[dim] == 1 else S(dim) if ok(s, dim) else None for s in (*ins, *outs)]
        if None not in place and any(p != R for p in place):
            result.append(Strategy(name, tuple(place[:len(ins)]), tuple(place[len(ins):]), True))
    return result


def _embedding(ins, outs, ok) -> list[Strategy]:
    weight, indices, out = ins[0], ins[1], outs[0]
    rest = tuple(R for _ in ins[2:])
    result = []
    if ok(weight, 0):
        result.append(Strategy("vocab", (S(0), R) + rest, (P,), False))
    if ok(weight, 1) and ok(out, len(out) - 1):
        result.append(Strategy("hidden", (S(1), R) + rest, (S(len(out) - 1),), True))
    result += [Strategy(f"tokens-{d}", (R, S(d)) + rest, (S(d),), True) for d in range(len(indices)) if ok(indices, d)]
    return result


def _embedding_backward(ins, outs, ok) -> list[Strategy]:
    grad, indices, out = ins[0], ins[1], outs[0]
    rest = tuple(R for _ in ins[2:])
    result = []
    if ok(grad, len(grad) - 1) and ok(out, 1):
        result.append(Strategy("hidden", (S(len(grad) - 1), R) + rest, (S(1),), True))
    result += [Strategy(f"tokens-{d}", (S(d), S(d)) + rest, (P,), True)
               for d in range(len(indices)) if ok(indices, d) and ok(grad, d)]
    if ok(out, 0):
        result.append(Strategy("vocab", (R, R) + rest, (S(0),), False))
    return result


def _norm(kind, ins, outs, ok) -> list[Strategy]:
    """Layer / RMS norm: the normalized dims are where the saved statistics have size 1."""
    x = ins[0] if "backward" not in kind else ins[1] if len(ins) > 1 else ins[0]
    stats = [s for s in (outs[1:] if "backward" not in kind else ins[2:]) if len(s) == len(x)]
    normalized = {d for d in range(len(x)) if any(s[d] == 1 and x[d] != 1 for s in stats)}
    if not stats:
        normalized = {len(x) - 1}
    result = []
    for d in range(len(x)):
        if d in normalized or not ok(x, d):
            continue
        inputs = tuple(S(d) if len(s) == len(x) and s[d] == x[d] else R for s in ins)
        if "backward" in kind:
            outputs = tuple(S(d) if s == x else P for s in outs)
        else:
            outputs = tuple(S(d) if len(s) == len(x) and s[d] == x[d] else R for s in outs)
        result.append(Strategy(f"S({d})", inputs, outputs, True))
    return result


def _vocab_softmax(kind, node: OpNode, ok) -> list[Strategy]:
    """Softmax over a sharded class dim (Megatron's vocab-parallel cross entropy): all-reduce the
    row maxima and sums in forward, the row sums of grad·softmax in backward (fp32 statistics)."""
    ins = [m.shape for m in node.input_meta]
    if not ins or not ins[0] or not ok(ins[0], len(ins[0]) - 1):
        return []
    last = len(ins[0]) - 1
    stats = ("all_reduce", 4 * math.prod(ins[0]) // ins[0][last])
    inputs = tuple(S(last) if s == ins[0] else R for s in ins)
    outputs = tuple(S(last) for _ in node.output_meta)
    return [Strategy("vocab", inputs, outputs, True, (stats,) if "backward" in kind else (stats, stats))]


def _nll_loss(kind, ins, outs, ok) -> list[Strategy]:
    """rows: split the batch, the loss becomes a partial sum; vocab: each rank picks the targets in
    its class range (Megatron's vocab-parallel cross entropy), the loss again partial."""
    rows = ins[1] if "backward" in kind else ins[0]  # the [N, C] log-probabilities
    result = []
    if len(rows) == 2 and ok(rows, 0):
        inputs = tuple(S(0) if len(s) >= 1 and s[0] == rows[0] else R for s in ins)
        outputs = tuple(S(0) if len(s) >= 1 and s[0] == rows[0] else P for s in outs)
        result.append(Strategy("rows", inputs, outputs, True))
    if len(rows) == 2 and ok(rows, 1):
        inputs = tuple(S(1) if s == rows else R for s in ins)
        outputs = tuple(S(1) if s == rows else P if i == 0 else R for i, s in enumerate(outs))
        result.append(Strategy("vocab", inputs, outputs, True))
    return result


def align(shape: tuple[int, ...], ref: tuple[int, ...]) -> list[int | None]:
    """For each dim of `ref`, the dim of `shape` it lines up with: broadcasting right-aligns a
    smaller shape; a reduction that dropped dims matches the kept ones from the left."""
    if len(shape) == len(ref):
        return list(range(len(ref)))
    if len(shape) < len(ref):
        lead = len(ref) - len(shape)
        return [d - lead if d >= lead else None for d in range(len(ref))]
    result, i = [], 0
    for size in ref:
        while i < len(shape) and shape[i] != size:
            i += 1
        result.append(i if i < len(shape) else None)
        i += 1
    return result


def _to_ref(shape, ref, reduced: bool) -> list[int | None]:
    """For each dim of `ref` (the op's largest tensor), the dim of `shape` it lines up with; a
    smaller output is a reduction of ref (kept dims matched from the left), a smaller input
    broadcasts (right-aligned)."""
    if not reduced or len(shape) >= len(ref):
        return align(shape, ref)
    result: list[int | None] = [None] * len(ref)
    for own, dim in enumerate(align(ref, shape)):
        if dim is not None:
            result[dim] = own
    return result


def _pointwise(ins, outs, ok, excluded: set[int] = frozenset()) -> list[Strategy]:
    if not outs:
        return []
    ref = max((*ins, *outs), key=len)
    result = []
    for d in range(len(ref)):
        if d in excluded or not ok(ref, d):
            continue
        placements = []
        for index, shape in enumerate((*ins, *outs)):
            a = _to_ref(shape, ref, reduced=index >= len(ins))[d]
            if a is not None and shape[a] == ref[d]:
                placements.append(S(a))
            elif a is None or shape[a] == 1:
                placements.append(R)
            else:
                placements = None
                break
        if placements is not None and any(p != R for p in placements[len(ins):]):
            result.append(Strategy(f"S({d})", tuple(placements[:len(ins)]), tuple(placements[len(ins):]), True))
    return result


def _reduce_to_partial(shape, outs, ok) -> list[Strategy]:
    """sum / mean over a sharded dim: each rank reduces its block, the results are partial sums."""
    if len(outs[0]) == len(shape):  # keepdim
        kept = {d for d in range(len(shape)) if outs[0][d] == shape[d]}
    else:
        kept = {a for a in align(shape, outs[0]) if a is not None}
    return [Strategy(f"reduce-S({d})", (S(d),), tuple(P for _ in outs), True)
            for d in range(len(shape)) if d not in kept and ok(shape, d)]


def _linear(kind, ins, outs) -> list[Strategy]:
    """P passes through ops linear in their inputs (R converts to P for free)."""
    if not outs:
        return []
    out = tuple(P for _ in outs)
    if kind in ("add", "sub"):
        return [Strategy("partial", tuple(P for _ in ins), out, False)] if len(ins) >= 2 else []
    if kind in ("mul", "div"):
        positions = range(len(ins)) if kind == "mul" else range(1)
        return [Strategy(f"partial-{i}", tuple(P if j == i else R for j in range(len(ins))), out, False)
                for i in positions]
    if kind in _LINEAR_UNARY:
        return [Strategy("partial", tuple(P for _ in ins), out, False)]
    return []


def view_dim_map(kind: str, shape: tuple[int, ...], out: tuple[int, ...], tp: int) -> list[int | None]:
    """Where a view sends each dim of its input: the output dim a shard on it becomes, or None
    where the shard does not survive as one (and must be gathered before the view)."""
    identity = list(range(len(shape)))
    if kind == "t":
        return [1, 0] if len(shape) == 2 else identity
    if kind in _PERMUTING_VIEWS:
        return _permutation(shape, out)
    if shape == out:
        return identity
    if math.prod(shape) == math.prod(out):
        return _regroup(shape, out, tp)
    if len(shape) == len(out):  # slices: dims that kept their size keep their shard
        return [d if shape[d] == out[d] else None for d in identity]
    if len(shape) < len(out):  # expand: right-aligned
        lead = len(out) - len(shape)
        return [d + lead if shape[d] == out[d + lead] else None for d in identity]
    back = align(shape, out)  # select-like: out dim ← input dim
    result: list[int | None] = [None] * len(shape)
    for o, a in enumerate(back):
        if a is not None:
            result[a] = o
    return result


def _permutation(shape, out) -> list[int | None]:
    """A permutation read off the shapes: a swap of two dims of different sizes, else each dim whose
    size is unique on both sides; dims of repeated sizes are ambiguous and map to None."""
    diff = [d for d in range(len(shape)) if shape[d] != out[d]] if len(shape) == len(out) else []
    if len(diff) == 2 and shape[diff[0]] == out[diff[1]] and shape[diff[1]] == out[diff[0]]:
        result = list(range(len(shape)))
        result[diff[0]], result[diff[1]] = diff[1], diff[0]
        return result
    return [out.index(size) if shape.count(size) == 1 and out.count(size) == 1 else None for size in shape]


def _regroup(shape, out, tp) -> list[int | None]:
    """Reshape: dims split and merge in groups of equal products; a shard survives on a group's
    leading dim (contiguous blocks of the flattened group) when the leading dims divide by tp."""
    result: list[int | None] = [None] * len(shape)
    i = j = 0
    while i < len(shape) and j < len(out):
        while i < len(shape) and shape[i] == 1:
            i += 1
        while j < len(out) and out[j] == 1:
            j += 1
        if i >= len(shape) or j >= len(out):
            break
        group_in, group_out = [i], [j]
        pi, pj = shape[i], out[j]
        while pi != pj:
            if pi < pj:
                i += 1
                group_in.append(i)
                pi *= shape[i]
            else:
                j += 1
                group_out.append(j)
                pj *= out[j]
        single = len(group_in) == len(group_out) == 1
        if single or (shape[group_in[0]] % tp == 0 and out[group_out[0]] % tp == 0):
            result[group_in[0]] = group_out[0]
        i, j = group_in[-1] + 1, group_out[-1] + 1
    return result


def input_names(node: OpNode) -> list[str]:
    """The producer of each entry of node.input_meta (empty if the graph did not record it)."""
    return node.input_names if len(node.input_names) == len(node.input_meta) else []


def gradient_tensors(ops: list[OpNode], consumers: dict[str, list[OpNode]], params: dict) -> dict[str, tuple]:
    """Parameter → (node, output index) holding its gradient: a backward output no op of `ops` reads
    (a step output, or a tied weight's share summed elsewhere), matched to a parameter the ops read
    by shape, within its module first."""
    inside = {node.name for node in ops}
    candidates = []
    for node in ops:
        if node.phase == "backward":
            read = {m.shape for c in consumers.get(node.name, []) if c.name in inside
                    for n, m in zip(input_names(c), c.input_meta) if n == node.name}
            candidates += [(node, i) for i, m in enumerate(node.output_meta) if m.shape not in read]
    order = [n[6:] for node in ops if node.phase == "forward"
             for n in input_names(node) if n.startswith("param:") and n[6:] in params]
    found: dict[str, tuple] = {}
    used: set[int] = set()
    for name in dict.fromkeys(order):
        info = params[name]
        for same_module in (True, False):
            match = next((i for i, (node, k) in enumerate(candidates) if i not in used
                          and tuple(node.output_meta[k].shape) == tuple(info.shape)
                          and (node.module_path == info.module_path or not same_module)), None)
            if match is not None:
                used.add(match)
                found[name] = candidates[match]
                break
    return found


def trace_views(name: str, meta, by_name: dict[str, OpNode], inside: set[str], index: int | None = None):
    """Follow views (within `inside`) back from a tensor to the op, parameter or external tensor
    that produced it: ((root name, output index), [(view node, input meta, output meta)] from
    the root outwards). The graph names producers, not outputs: the index is the first output of
    the tensor's shape unless `index` (of `name`'s outputs) says otherwise."""
    if index is not None and (name not in inside or not by_name[name].is_view):
        return (name, index), []
    chain = []
    while name in inside and by_name[name].is_view and input_names(by_name[name]):
        view = by_name[name]
        chain.append((view, view.input_meta[0], meta))
        name, meta = view.input_names[0], view.input_meta[0]
    outputs = by_name[name].output_meta if name in by_name else []
    return (name, next((i for i, m in enumerate(outputs) if m.shape == meta.shape), 0)), chain[::-1]


def through_views(placement: str, chain, tp: int, scale: float, breaks: dict[str, float]) -> str:
    """The placement a root placement has after the views of `chain`; where a view cannot carry a
    shard, the tensor is gathered first (its bytes × scale recorded in `breaks`) and continues R."""
    for view, source, target in chain:
        dim = shard_dim(placement)
        if dim is None:
            continue
        mapped = view_dim_map(packet(view.op), source.shape, target.shape, tp)
        if dim < len(mapped) and mapped[dim] is not None:
            placement = S(mapped[dim])
        else:
            breaks[view.name] = source.bytes * scale
            placement = R
    return placement
