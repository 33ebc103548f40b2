"""The communication ledger: which collectives one training step sends, per mesh axis.

The evaluator prices communication as times; this lists the same traffic as calls and bytes, per
pipeline rank, so a run can be checked against it (`runtime.collectives` counts what executes).
It follows the runtime's algorithm, which the evaluator costs:
- tp: per micro-batch, every partial sum the op graph reduces (an all-reduce; under sequence
  parallelism a reduce-scatter plus an all-gather of the same size), forward and backward; when a
  pipeline's last stage gathers logits sharded over the vocabulary, one all-gather per micro-batch;
  with the loss on vocabulary shards (pp=1), its three small reductions (max, sum of
  exponentials, target logit) per micro-batch;
- tp, full recompute (of the layers the strategy recomputes): a layer's forward reductions
  again, but for the one producing the layer's output (its backward needs nothing after it, so
  recomputation stops before it); under sequence parallelism that output's all-gather into the
  next block is still repeated. Selective recompute saves collectives' outputs and repeats none;
- dp, ZeRO 0: the gradients all-reduced once per step in buckets; ZeRO 1-3 (FSDP, one unit per
  layer plus one for the rest of the stage): weights all-gathered at the first forward (ZeRO 1/2)
  or every forward and backward (ZeRO 3), gradients reduce-scattered once per step (ZeRO 1) or per
  micro-batch (ZeRO 2/3); under ep the experts are FSDP units of their own over their dp/ep
  replicas (axis "edp", `cost_models.experts`), gathered and scattered as often, none when ep = dp;
- pp: per micro-batch and stage boundary, a send and a receive of each tensor crossing the cut
  (`Unit.cut`: hidden states, an encoder's output, position biases; not what every stage
  recomputes from the inputs), and of the gradient back for each that carries one; the weights
  held on several pipeline ranks (a tied embedding and head) summed once per step;
- tp, sequence parallel: the gradients of norms (replicated weights that saw sequence shards)
  summed once per step, flattened into one all-reduce; under FSDP (ZeRO 1-3), FSDP sums them
  itself, one all-reduce per tensor at each gradient reduce-scatter;
- world: the global gradient norm (when clipping) and the logged loss, one scalar each (counted
  on an axis that spans the whole world when there is one: it is the same communicator).
Gradients are reduced in fp32 under mixed precision (as FSDP2's reduce dtype and Megatron-LM do).

The tp traffic above is the Megatron layout's, found by propagating shards through the op graph.
Plans with per-parameter placements (the intra-op ILP's) run module by module as the placements
say, so `placed_units` rewrites the units' collectives from the placements and the runtime's rules
(which layers, blocks, head and embeddings are sharded, and what full recompute resends).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.graph.ir import OpGraph, OpNode
from autopar.plan_schema import Strategy
from autopar.cost_models.context import AttentionLayer, rank_batch, replica_axis, replicas, unit_exchanges
from autopar.cost_models.experts import (ExpertLayer, all_to_all_axis, fsdp_expert_elements, unit_all_to_alls,
                                         unit_expert_params)
from autopar.cost_models.facts import OpFacts, Unit
from autopar.cost_models.recompute import stage_policies

GRADIENT_REDUCE_BYTES = 4  # fp32 gradient reduction, whatever the compute precision
BUCKET_BYTES = 25 * 2**20  # the runtime's zero-0 gradient bucket
SCALAR_BYTES = 4
LOSS_PARALLEL_REDUCTIONS = 3  # max, sum of exponentials, target logit: one value per token each


def step_collectives(stages: list[list[Unit]], strategy: Strategy, precision: str, pp_rank: int, *,
                     seq_len: int, vocab: int | None = None, clip_grad_norm: bool = True,
                     recompute_repeats: dict[str, tuple[tuple[str, float], ...]] | None = None,
                     tp_step: Sequence[tuple[str, float]] = (), selective_repeats: bool = False,
                     experts: Sequence[ExpertLayer] = (), attention: Sequence[AttentionLayer] = (),
                     ) -> dict[tuple[str, str], tuple[int, float]]:
    """{(axis, kind): (calls, bytes)} one step sends on pipeline rank `pp_rank`.

    `stages` are the pp·vp lists of units (stage i on pipeline rank i mod pp). `vocab` is given when
    the head's logits are sharded over the vocabulary. `recompute_repeats` (per layer unit: kind and
    bytes per sample) replaces the Megatron-layout rule of `recomputed_reductions`, for layouts
    given by per-parameter placements (`placed_units`, `dry_run_units`). `tp_step` lists tp
    collectives sent once per step after the last backward (a dry run's gradient synchronization).
    `selective_repeats`: `recompute_repeats` are resent under selective recompute too (a dry run saw
    selective recompute repeat collectives DTensor issues inside an op, which it cannot save).
    `experts`: the model's MoE layers; under ep > 1 their all-to-alls (`cost_models.experts`) and the
    expert gradients' sum over their dp/ep replicas ("edp") replace the experts' share of dp's.
    `attention`: the model's attention calls; under cp > 1 each sends its exchange (`cost_models.context`:
    "cp" send/recv for the ring, all_to_all for ulysses), every per-token size is one rank's S/cp share,
    and the gradient sync and ZeRO's collectives span dp × cp ("dp_cp").
    """
    s = strategy
    tied = tied_across_ranks(stages, s.pp, s.tp)[pp_rank]
    calls: Counter = Counter()
    sent: Counter = Counter()

    def add(axis: str, kind: str, num_bytes: float, times: int = 1) -> None:
        if times:
            calls[(axis, kind)] += times
            sent[(axis, kind)] += num_bytes * times

    weight_bytes = {"fp32": 4, "bf16": 2, "fp16": 2}[precision]
    m, b = s.num_microbatches, rank_batch(s)  # b: one rank's positions, in sequences (b/cp under cp)
    copies, dp_axis = replicas(s), replica_axis(s)
    mine = [i for i in range(len(stages)) if i % s.pp == pp_rank]
    last = len(stages) - 1
    for index in mine:
        units = stages[index]
        if s.tp > 1:
            for unit, policy in zip(units, stage_policies(units, s, index)):
                for op in unit.ops:
                    if op.reduce_bytes:
                        size = op.reduce_bytes_for(b, 1 / s.cp)
                        if s.sp:
                            add("tp", "reduce_scatter", size, m)
                            add("tp", "all_gather", size, m)
                        else:
                            add("tp", "all_reduce", size, m)
                    for kind, size in op.collectives:
                        add("tp", kind, size * b, m)
                if policy == "full" or (policy == "selective" and selective_repeats and recompute_repeats):
                    repeats = (recomputed_reductions(unit, b, s.sp, 1 / s.cp) if recompute_repeats is None
                               else [(kind, size * b, 1) for kind, size in recompute_repeats.get(unit.name, ())])
                    for kind, size, times in repeats:
                        add("tp", kind, size, m * times)
            if index == last and vocab:
                for kind, size, times in vocab_parallel_head_collectives(s, precision, seq_len, vocab):
                    add("tp", kind, size, m * times)
        if s.cp > 1:
            for unit, policy in zip(units, stage_policies(units, s, index)):
                for _, kind, size, calls_per_microbatch in unit_exchanges(attention, unit.name, s, policy):
                    add("cp", kind, size, m * calls_per_microbatch)
        if s.ep > 1:
            for unit, policy in zip(units, stage_policies(units, s, index)):
                for _, size, per_pass in unit_all_to_alls(experts, unit.name, b, policy):
                    add(all_to_all_axis(s), "all_to_all", size, m * per_pass)
        if s.pp > 1:
            shard = s.tp if s.sp else 1
            if index > 0 and units:
                for tensor in units[0].cut:
                    add("pp", "recv", tensor.bytes_for(b) / shard, m)  # activations in
                    add("pp", "send", tensor.bytes_for(b) / shard, m if tensor.grad else 0)  # their gradients back
            if index < last and stages[index + 1]:
                for tensor in stages[index + 1][0].cut:
                    add("pp", "send", tensor.bytes_for(b) / shard, m)
                    add("pp", "recv", tensor.bytes_for(b) / shard, m if tensor.grad else 0)
        if copies > 1 and s.zero >= 1:
            tied_copies = sum(n for stage, n in tied["copies"] if stage == index)
            moe = experts if s.ep > 1 else ()
            gathered = _fsdp_unit_params(units, s.tp, copies, tied_copies, experts=moe)
            reduced = _fsdp_unit_params(units, s.tp, copies, tied_copies, gradients=True, experts=moe)
            gathers = 2 * m if s.zero >= 3 else 1
            scatters = m if s.zero >= 2 else 1
            for unit_params, unit_grads in zip(gathered, reduced):
                add(dp_axis, "all_gather", unit_params * weight_bytes, gathers)
                if unit_grads:
                    add(dp_axis, "reduce_scatter", unit_grads * GRADIENT_REDUCE_BYTES, scatters)
            expert_replicas = s.dp // s.ep  # ep shares dp's ranks only (cp > 1 is refused with ep)
            for layer in moe if expert_replicas > 1 else ():  # each MoE layer's expert slices: a unit over "edp"
                local = fsdp_expert_elements([layer], layer.unit, s.ep, expert_replicas)
                if any(layer.unit == u.name for u in units):
                    add("edp", "all_gather", local * weight_bytes, gathers)
                    add("edp", "reduce_scatter", local * GRADIENT_REDUCE_BYTES, scatters)
    if copies > 1 and s.zero == 0:
        rank_params = sum(u.trainable_on_device(s.tp) for i in mine for u in stages[i]) + sum(n for _, n in tied["copies"])
        rank_experts = sum(unit_expert_params(experts, u.name) for i in mine for u in stages[i]) if s.ep > 1 else 0
        for axis, elements in ((dp_axis, rank_params - rank_experts),
                               ("edp", rank_experts / s.ep if s.dp > s.ep else 0)):
            grad_bytes = elements * GRADIENT_REDUCE_BYTES
            if grad_bytes:
                buckets = max(1, math.ceil(grad_bytes / BUCKET_BYTES))
                add(axis, "all_reduce", grad_bytes / buckets, buckets)
    for size, times in sequence_parallel_gradient_reductions([u for i in mine for u in stages[i]], s):
        add("tp", "all_reduce", size, times)
    if s.tp > 1:
        for kind, size in tp_step:
            add("tp", kind, size)
    if tied["summed"]:  # the local shard of each tied weight, summed over the ranks holding it
        add("pp", "all_reduce", tied["summed"] / (copies if s.zero >= 1 else 1) * GRADIENT_REDUCE_BYTES)
    add("world", "all_reduce", SCALAR_BYTES, 2 if clip_grad_norm else 1)
    return {key: (calls[key], sent[key]) for key in sorted(calls)}


def vocab_parallel_head_collectives(strategy: Strategy, precision: str, seq_len: int, vocab: int
                                    ) -> list[tuple[str, float, int]]:
    """(kind, bytes, calls) per micro-batch after a head whose logits are sharded over the vocabulary:
    a pipeline's last stage gathers them (stages pass plain tensors); without a pipeline the loss
    runs on the shards and reduces three values per predicted token (the evaluator charges these too)."""
    s = strategy
    activation_bytes = 4  # logits leave autocast in fp32 (and are fp32 under fp32)
    if s.pp > 1:
        return [("all_gather", s.microbatch * seq_len / s.cp * vocab * activation_bytes, 1)]
    # next-token loss: every position but the last predicts one; under cp each rank's S/cp positions
    # (the last one's target masked where it has none, so every cp rank reduces the same sizes)
    positions = seq_len - 1 if s.cp == 1 else seq_len / s.cp
    return [("all_reduce", s.microbatch * positions * SCALAR_BYTES, LOSS_PARALLEL_REDUCTIONS)]


def tied_across_ranks(stages: list[list[Unit]], pp: int, tp: int) -> list[dict]:
    """Per pipeline rank: "copies" [(stage index, tp-local elements)] of tied weights it holds
    but another rank owns, and "summed": tp-local elements of tied weights whose gradient it sums
    with other ranks (owner and holders alike)."""
    rank_of_unit = {u.name: i % pp for i, units in enumerate(stages) for u in units}
    result = [{"copies": [], "summed": 0.0} for _ in range(pp)]
    seen: set[tuple[str, int]] = set()
    for index, units in enumerate(stages):
        rank = index % pp
        for unit in units:
            for owner, elements, sharded in unit.borrowed:
                owner_rank = rank_of_unit.get(owner)
                if owner_rank is None or owner_rank == rank:
                    continue
                local = elements / (tp if sharded else 1)
                result[rank]["copies"].append((index, local))
                for holder in (rank, owner_rank):
                    if (owner, holder) not in seen:
                        seen.add((owner, holder))
                        result[holder]["summed"] += local
    return result


def _fsdp_unit_params(units: list[Unit], tp: int, dp: int, root_copies: float = 0.0,
                      gradients: bool = False, experts: Sequence[ExpertLayer] = ()) -> list[float]:
    """Elements per FSDP unit of a stage, padded as FSDP2 pads them: each layer its own, the rest of
    the stage the root's. `gradients`: what its reduce-scatter moves (frozen parameters left out),
    one entry per unit that has parameters, aligned with the gathered list. `experts` (under ep):
    MoE layers whose expert weights are units of their own (over "edp"), left out here."""
    def size(u: Unit) -> float:
        whole = u.fsdp_reduced_params(tp, dp) if gradients else u.fsdp_gathered_params(tp, dp)
        # the expert weights as `Unit` counted them: each padded on its first dimension over dp
        return whole - sum(-(-shape[0] // dp) * dp * math.prod(shape[1:]) for layer in experts
                           if layer.unit == u.name for shape in layer.param_shapes)
    held = [u for u in units if u.layer_type is not None and u.fsdp_gathered_params(tp, dp)]
    root = [u for u in units if u.layer_type is None]
    root_size = sum(size(u) for u in root) + root_copies
    has_root = sum(u.fsdp_gathered_params(tp, dp) for u in root) + root_copies
    return [size(u) for u in held] + ([root_size] if has_root else [])


def merge_world(ledger: dict[tuple[str, str], tuple[int, float]], axis_sizes: dict[str, int]
                ) -> dict[tuple[str, str], tuple[int, float]]:
    """Count "world" collectives under the mesh axis that spans the whole world, if one does."""
    world = math.prod(axis_sizes.values())
    spanning = [axis for axis, size in axis_sizes.items() if size == world and world > 1]
    if not spanning:
        return dict(ledger)
    merged: dict[tuple[str, str], tuple[int, float]] = {}
    for (axis, kind), (calls, size) in ledger.items():
        key = (spanning[0] if axis == "world" else axis, kind)
        before = merged.get(key, (0, 0.0))
        merged[key] = (before[0] + calls, before[1] + size)
    return merged


def recomputed_reductions(unit: Unit, batch: float, sp: bool, share: float = 1.0) -> list[tuple[str, float, int]]:
    """(kind, bytes, calls) a full recompute of `unit` repeats per micro-batch (`share`: 1/cp)."""
    sizes = [op.reduce_bytes_for(batch, share) for op in unit.forward_ops if op.reduce_bytes]
    if not sizes:
        return []
    repeated = [(("reduce_scatter" if sp else "all_reduce"), size, 1) for size in sizes[:-1]]
    if sp:
        repeated += [("all_gather", size, 1) for size in sizes]
    return repeated


def sequence_parallel_gradient_reductions(units: list[Unit], strategy: Strategy) -> list[tuple[float, int]]:
    """(bytes, calls) summing norm gradients over tp under sequence parallelism, on one pipeline rank."""
    s = strategy
    if s.tp <= 1 or not s.sp:
        return []
    elements = sum(u.sequence_parallel_params for u in units)
    tensors = sum(u.sequence_parallel_tensors for u in units)
    if not elements:
        return []
    if s.zero >= 1:
        syncs = s.num_microbatches if s.zero >= 2 else 1
        return [(elements / tensors * GRADIENT_REDUCE_BYTES, tensors * syncs)]
    return [(elements * GRADIENT_REDUCE_BYTES, 1)]


# --- layouts given by per-parameter placements (the intra-op ILP's plans) -----------------------

@dataclass(frozen=True)
class PlacedLayout:
    """Units whose ops carry the tp collectives the runtime sends for given parameter placements."""

    units: dict[str, Unit]  # by unit name
    recompute_repeats: dict[str, tuple[tuple[str, float], ...]]  # layer unit -> (kind, bytes per sample) resent
    vocab_parallel_head: bool  # the head's logits come out sharded over the vocabulary (and `step_collectives`
    # adds the gathering or the loss's reductions; a dry run's layout lists those among its own)
    step: tuple[tuple[str, float], ...] = ()  # tp collectives (kind, bytes) sent once per step
    selective_repeats: bool = False  # `recompute_repeats` hold under selective recompute too (see step_collectives)


def placed_units(graph: OpGraph, units: Sequence[Unit], tp_placements: dict[str, str], microbatch: int) -> PlacedLayout:
    """The tensor parallelism `runtime.tensor_parallel` executes (without sequence parallelism) for
    the tp placements "R", "S(0)", "S(1)" of each parameter (absent: R), as units `step_collectives` reads.

    Per micro-batch, by module (what DTensor's parallel styles send; the graph gives the sizes):
    - a row-parallel Linear (weight S(1)): its output all-reduced in forward;
    - a block (a module whose direct Linear children are column and row parallel): the gradient of
      its input all-reduced in backward, once for all its column-parallel projections;
    - a column-parallel head (the last Linear to run): the gradient of its input all-reduced in
      backward (its logits: `step_collectives` with `vocab`);
    - an Embedding S(0): its output all-reduced; S(1): its output all-gathered;
    - replicated modules nothing, their gradients included: their inputs are whole on every rank.
    Under full recompute a layer's forward collective is resent when the layer's backward reads an
    activation produced after it: recomputation stops once the last such activation is rebuilt.
    """
    by_name = {node.name: node for node in graph.nodes}
    order = {node.name: i for i, node in enumerate(graph.nodes)}
    per_sample = 1.0 / max(graph.batch, 1)
    unit_of = {op.name: unit.name for unit in units for op in unit.ops}
    layer_units = {unit.name for unit in units if unit.layer_type is not None}
    backward: dict[str, list[OpNode]] = {}  # unit -> its backward nodes, in graph order
    for node in graph.nodes:
        if node.phase == "backward":
            backward.setdefault(unit_of.get(node.name, ""), []).append(node)

    def backward_node(module: str, forward_node: OpNode) -> OpNode:
        """A backward op of `module` in its forward op's unit, to carry a backward collective."""
        inside = [n for n in backward.get(unit_of.get(forward_node.name, ""), []) if _inside(n.module_path, module)]
        return inside[-1] if inside else forward_node

    def placement(param: str) -> str:
        return tp_placements.get(param, "R")

    linears, embeddings, weight_of = _weighted_modules(graph)
    kind = {path: {"S(0)": "col", "S(1)": "row"}.get(placement(weight_of[path]), "rep") for path in linears}
    head = max(linears, key=lambda path: order[linears[path].name]) if linears else None

    moves: dict[str, list[tuple[str, float, bool]]] = {}  # node -> (kind, bytes, per micro-batch rather than sample)
    forward: list[tuple[str, str, float]] = []  # (node, kind, bytes per sample) sent in forward

    def send(node: OpNode, collective: str, meta_bytes: float, unbatched: bool = False) -> None:
        size = meta_bytes if unbatched else meta_bytes * per_sample
        moves.setdefault(node.name, []).append((collective, size, unbatched))
        if node.phase == "forward":
            forward.append((node.name, collective, size / microbatch if unbatched else size))

    for path, node in linears.items():
        if kind[path] == "row":
            send(node, "all_reduce", node.output_meta[0].bytes)
    children: dict[str, list[str]] = {}
    for path in linears:
        if path != head:
            children.setdefault(path.rpartition(".")[0], []).append(path)
    for block, paths in children.items():
        kinds = {kind[p] for p in paths}
        if "col" in kinds and "row" in kinds:
            first = min((linears[p] for p in paths if kind[p] == "col"), key=lambda n: order[n.name])
            send(backward_node(block, first), "all_reduce", _entering_bytes(by_name, first, block))
    if head is not None and kind[head] == "col":
        send(backward_node(head, linears[head]), "all_reduce",
             _entering_bytes(by_name, linears[head], head))
    for path, node in embeddings.items():
        where = placement(weight_of[path])
        if where in ("S(0)", "S(1)"):
            out = node.output_meta[0]
            send(node, "all_reduce" if where == "S(0)" else "all_gather", out.bytes, unbatched=len(out.shape) == 2)

    repeats = _resent_by_recompute(graph, unit_of, layer_units, forward)
    placed = _with_moves_and_shards(graph, units, unit_of, tp_placements, moves, microbatch)
    return PlacedLayout(placed, repeats, head is not None and kind[head] == "col")


def dry_run_units(graph: OpGraph, units: Sequence[Unit], collectives: Sequence, tp_placements: dict[str, str],
                  microbatch: int, recompute_policy: str = "full") -> PlacedLayout:
    """Units carrying exactly the tp collectives a dry run of the placements recorded
    (`runtime.tp_dry_run`: each `autopar.capabilities.TpCollective` with its phase and module),
    for a micro-batch of `microbatch` samples, as `step_collectives` and the evaluator read them.

    Each forward (backward) collective is carried by a forward (backward) op of the unit holding
    the module that sent it (the innermost module the graph knows; the root's, the loss's, go to
    the last unit), in bytes per sample; recomputation's (under `recompute_policy`), per recomputed
    layer; the step's once.
    The work each op does is left as the units give it (`model_facts` under these shards)."""
    unit_of = {op.name: unit.name for unit in units for op in unit.ops}
    unit_of_module: dict[str, str] = {}
    for node in graph.nodes:
        if node.phase == "forward" and node.name in unit_of:
            unit_of_module.setdefault(node.module_path, unit_of[node.name])
    last = units[-1].name if units else ""

    def unit_for(module: str) -> str:
        path = module
        while path:
            if path in unit_of_module:
                return unit_of_module[path]
            path = path.rpartition(".")[0]
        return last

    carrier: dict[tuple[str, str], str] = {}  # (unit, phase) -> the op carrying its collectives
    for unit in units:
        for phase in ("forward", "backward"):
            ops = [op for op in unit.ops if op.phase == phase] or list(unit.ops)
            if ops:
                carrier[(unit.name, phase)] = ops[-1 if phase == "forward" else 0].name
    moves: dict[str, list[tuple[str, float, bool]]] = {}
    repeats: dict[str, list[tuple[str, float]]] = {}
    step: list[tuple[str, float]] = []
    for record in collectives:
        unit = unit_for(record.module)
        if record.phase == "step":
            step.append((record.kind, float(record.bytes)))
        elif record.phase == "recompute":
            repeats.setdefault(unit, []).append((record.kind, record.bytes / microbatch))
        else:
            moves.setdefault(carrier[(unit, record.phase)], []).append((record.kind, record.bytes / microbatch, False))
    placed = _with_moves_and_shards(graph, units, unit_of, tp_placements, moves, microbatch)
    return PlacedLayout(placed, {unit: tuple(items) for unit, items in repeats.items()}, False, tuple(step),
                        selective_repeats=recompute_policy == "selective")


def dry_run_ledger(collectives: Sequence, microbatches: int, recomputed: set[str] | frozenset[str] = frozenset()
                   ) -> dict[str, tuple[int, int]]:
    """{kind: (calls, bytes)} a dry run's collectives add up to over tp in a step of `microbatches`
    micro-batches, the layers named in `recomputed` recomputing (the others' "recompute" records dropped)."""
    calls: Counter = Counter()
    sent: Counter = Counter()
    for record in collectives:
        if record.phase == "recompute" and record.module not in recomputed:
            continue
        times = 1 if record.phase == "step" else microbatches
        calls[record.kind] += times
        sent[record.kind] += record.bytes * times
    return {kind: (calls[kind], sent[kind]) for kind in sorted(calls)}


def _with_moves_and_shards(graph: OpGraph, units: Sequence[Unit], unit_of: dict[str, str],
                           tp_placements: dict[str, str], moves: dict[str, list[tuple[str, float, bool]]],
                           microbatch: int) -> dict[str, Unit]:
    """Units whose ops send exactly `moves` (nothing else over tp), with parameters sharded as placed."""
    numel = {p.name: p.numel for p in graph.params}
    owner: dict[str, str] = {}  # a parameter belongs to the unit that reads it first (as in facts)
    read_by: dict[str, set[str]] = {}
    for node in graph.nodes:
        for param in node.params:
            owner.setdefault(param, unit_of.get(node.name, ""))
            if node.phase == "forward":
                read_by.setdefault(unit_of.get(node.name, ""), set()).add(param)

    def sharded(param: str) -> bool:
        return tp_placements.get(param, "R") != "R"

    placed = {}
    for unit in units:
        mine = [p for p, at in owner.items() if at == unit.name]
        placed[unit.name] = dataclasses.replace(
            unit, ops=tuple(_with_moves(op, moves.get(op.name, []), microbatch) for op in unit.ops),
            sharded_params=sum(numel[p] for p in mine if sharded(p)),
            borrowed=tuple((owner[p], numel[p], sharded(p))
                           for p in sorted(read_by.get(unit.name, ())) if owner[p] != unit.name),
        )
    return placed



def _packet(node: OpNode) -> str:
    parts = node.op.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else node.op


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def _entering_bytes(by_name: dict[str, OpNode], node: OpNode, module: str) -> float:
    """Bytes of the activation a Linear's contraction reads, where it enters `module` (before the
    module's own views and casts): what the module's input DTensor holds."""
    names = node.input_names or node.inputs
    for name, meta in zip(names, node.input_meta):
        while name in by_name and _inside(by_name[name].module_path, module) and (
                by_name[name].is_view or _packet(by_name[name]) == "_to_copy") and by_name[name].input_meta:
            producer = by_name[name]
            name, meta = (producer.input_names or producer.inputs)[0], producer.input_meta[0]
        if not name.startswith("param:"):
            return float(meta.bytes)
    return 0.0


def _weighted_modules(graph: OpGraph) -> tuple[dict[str, OpNode], dict[str, OpNode], dict[str, str]]:
    """Linear and Embedding modules by path (the forward op first reading their matrix), and that matrix."""
    shape = {p.name: p.shape for p in graph.params}
    linears: dict[str, OpNode] = {}
    embeddings: dict[str, OpNode] = {}
    weight_of: dict[str, str] = {}
    for node in graph.nodes:
        matrices = [p for p in node.params if len(shape[p]) == 2]
        if node.phase != "forward" or not matrices or not node.module_path:
            continue
        packet = _packet(node)
        table = embeddings if packet == "embedding" else linears if packet in ("mm", "addmm") else None
        if table is not None and node.module_path not in table:
            table[node.module_path] = node
            weight_of[node.module_path] = matrices[0]
    return linears, embeddings, weight_of


def _resent_by_recompute(graph: OpGraph, unit_of: dict[str, str], layer_units: set[str],
                         forward: list[tuple[str, str, float]]) -> dict[str, tuple[tuple[str, float], ...]]:
    """Per layer unit, the forward collectives (node, kind, bytes per sample) a full recompute resends:
    those before the last activation of the layer that the layer's backward reads."""
    order = {node.name: i for i, node in enumerate(graph.nodes)}
    phase = {node.name: node.phase for node in graph.nodes}
    saved_until: dict[str, int] = {}
    for node in graph.nodes:
        unit = unit_of.get(node.name)
        if node.phase == "backward" and unit in layer_units:
            for source in node.inputs:
                if phase.get(source) == "forward" and unit_of.get(source) == unit:
                    saved_until[unit] = max(saved_until.get(unit, -1), order[source])
    repeats: dict[str, list[tuple[str, float]]] = {}
    for name, collective, size in sorted(forward, key=lambda item: order[item[0]]):
        unit = unit_of.get(name)
        if unit in layer_units and order[name] < saved_until.get(unit, -1):
            repeats.setdefault(unit, []).append((collective, size))
    return {unit: tuple(items) for unit, items in repeats.items()}


def _with_moves(op: OpFacts, moves: list[tuple[str, float, bool]], microbatch: int) -> OpFacts:
    """`op` sending exactly `moves`: its first all-reduce as reduce_bytes, the rest as collectives."""
    reduces = [(size, unbatched) for kind, size, unbatched in moves if kind == "all_reduce"]
    first, unbatched = reduces[0] if reduces else (0.0, False)
    rest = [(kind, size / microbatch if flag else size) for kind, size, flag in moves if kind != "all_reduce"]
    rest += [("all_reduce", size / microbatch if flag else size) for size, flag in reduces[1:]]
    return dataclasses.replace(op, reduce_bytes=first, reduce_per_microbatch=unbatched, collectives=tuple(rest))


def head_vocab(facts, strategy: Strategy) -> int | None:
    """Under tp the runtime runs the head vocabulary-parallel (Megatron's layout): its collectives
    are charged from the vocabulary size (`vocab_parallel_head_collectives`)."""
    return facts.vocab if strategy.tp > 1 else None
