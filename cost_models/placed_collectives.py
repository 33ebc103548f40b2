"""The tp collectives of layouts given by per-parameter placements (the intra-op ILP's plans).

`collectives.step_collectives` lists Megatron's layout's tp traffic from the shards propagated
through the op graph. Plans with per-parameter placements run module by module as the placements
say, so `placed_units` rewrites the units' collectives from the placements and the runtime's rules
(which layers, blocks, head and embeddings are sharded, and what full recompute resends); when a
dry run of the placements is at hand (`runtime.tensor_parallel.dry_run`), `dry_run_units` carries exactly what
it recorded instead, and `dry_run_ledger` adds it up per step.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.graph.ir import OpGraph, OpNode
from autopar.cost_models.facts import OpFacts, Unit
from autopar.cost_models.tp_shards import op_packet


@dataclass(frozen=True)
class PlacedLayout:
    """Units whose ops carry the tp collectives the runtime sends for given parameter placements."""

    units: dict[str, Unit]  # by unit name
    recompute_repeats: dict[str, tuple[tuple[str, float], ...]]  # layer unit -> (kind, bytes per sample) resent
    vocab_parallel_head: bool  # the head's logits come out sharded over the vocabulary (and `step_collectives`
    # adds the gathering or the loss's reductions where given `vocab`; a dry run's layout lists those among
    # its own, and the evaluator is given none)
    step: tuple[tuple[str, float], ...] = ()  # tp collectives (kind, bytes) sent once per step
    selective_repeats: bool = False  # `recompute_repeats` hold under selective recompute too (see step_collectives)


def placed_units(graph: OpGraph, units: Sequence[Unit], tp_placements: dict[str, str], microbatch: int) -> PlacedLayout:
    """The tensor parallelism `runtime.tensor_parallel.module_rules` executes (without sequence parallelism) for
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


def head_shards_vocabulary(graph: OpGraph, tp_placements: dict[str, str]) -> bool:
    """Whether the head (the last Linear to run) is column-parallel: its logits come out sharded over
    the vocabulary, as the runtime's `vocab_parallel` reads the same placement."""
    order = {node.name: i for i, node in enumerate(graph.nodes)}
    linears, _, weight_of = _weighted_modules(graph)
    if not linears:
        return False
    head = max(linears, key=lambda path: order[linears[path].name])
    return tp_placements.get(weight_of[head], "R") == "S(0)"


def dry_run_units(graph: OpGraph, units: Sequence[Unit], collectives: Sequence, tp_placements: dict[str, str],
                  microbatch: int, recompute_policy: str = "full") -> PlacedLayout:
    """Units carrying exactly the tp collectives a dry run of the placements recorded
    (`runtime.tensor_parallel.dry_run`: each `autopar.capabilities.TpCollective` with its phase and module),
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
    # the head's sharding says how the loss runs (`cost_models.memory.LossLayout`); its collectives are
    # among the dry run's own, so the evaluator is given no `vocab` for them
    return PlacedLayout(placed, {unit: tuple(items) for unit, items in repeats.items()},
                        head_shards_vocabulary(graph, tp_placements), tuple(step),
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


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def _entering_bytes(by_name: dict[str, OpNode], node: OpNode, module: str) -> float:
    """Bytes of the activation a Linear's contraction reads, where it enters `module` (before the
    module's own views and casts): what the module's input DTensor holds."""
    names = node.input_names or node.inputs
    for name, meta in zip(names, node.input_meta):
        while name in by_name and _inside(by_name[name].module_path, module) and (
                by_name[name].is_view or op_packet(by_name[name]) == "_to_copy") and by_name[name].input_meta:
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
        packet = op_packet(node)
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
