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
  or every forward and backward (ZeRO 3), gradients reduce-scattered once per step (ZeRO 1, and ZeRO 3
  under pipeline stages: `memory.gradients_sharded`) or per micro-batch (ZeRO 2, ZeRO 3 without); under ep the experts are FSDP units of their own over their dp/ep
  replicas (axis "edp", `cost_models.experts`), gathered and scattered as often, none when ep = dp;
- pp: per micro-batch and stage boundary, a send and a receive of each tensor crossing the cut
  (`Unit.cut`: hidden states, an encoder's output, position biases; not what every stage
  recomputes from the inputs), and of the gradient back for each that carries one; the weights
  held on several pipeline ranks (a tied embedding and head) summed once per step;
- tp, sequence parallel: the gradients of norms (replicated weights that saw sequence shards)
  summed once per step, flattened into one all-reduce; under FSDP (ZeRO 1-3), FSDP sums them
  itself, one all-reduce per tensor at each gradient reduce-scatter; a table read along the sequence
  (a position table added to the stream) has each rank's rows: gathered once per step (ZeRO 0);
- world: the global gradient norm (when clipping) and the logged loss, one scalar each (counted
  on an axis that spans the whole world when there is one: it is the same communicator).
Gradients are reduced in fp32 under mixed precision (as FSDP2's reduce dtype and Megatron-LM do).

The tp traffic above is the Megatron layout's, found by propagating shards through the op graph.
Plans with per-parameter placements (the intra-op ILP's) run module by module as the placements
say, so `placed_collectives.placed_units` rewrites the units' collectives from the placements and
the runtime's rules (which layers, blocks, head and embeddings are sharded, and what full
recompute resends).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from autopar.plan_schema import Strategy, stage_rank
from autopar.cost_models.context import AttentionLayer, rank_batch, replica_axis, replicas, unit_exchanges
from autopar.cost_models.experts import (ExpertLayer, all_to_all_axis, fsdp_expert_elements, unit_all_to_alls,
                                         unit_expert_params)
from autopar.cost_models.facts import Unit
from autopar.cost_models.memory import gradients_sharded, runs_autocast
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
    given by per-parameter placements (`placed_collectives`: `placed_units`, `dry_run_units`).
    `tp_step` lists tp collectives sent once per step after the last backward (a dry run's gradient
    synchronization).
    `selective_repeats`: `recompute_repeats` are resent under selective recompute too (a dry run saw
    selective recompute repeat collectives DTensor issues inside an op, which it cannot save).
    `experts`: the model's MoE layers; under ep > 1 their all-to-alls (`cost_models.experts`) and the
    expert gradients' sum over their dp/ep replicas ("edp") replace the experts' share of dp's.
    `attention`: the model's attention calls; under cp > 1 each sends its exchange (`cost_models.context`:
    "cp" send/recv for the ring, all_to_all for ulysses), every per-token size is one rank's S/cp share,
    and the gradient sync and ZeRO's collectives span dp × cp ("dp_cp").
    """
    s = strategy
    tied = tied_across_ranks(stages, s.pp, s.tp, s.schedule)[pp_rank]
    calls: Counter = Counter()
    sent: Counter = Counter()

    def add(axis: str, kind: str, num_bytes: float, times: int = 1) -> None:
        if times:
            calls[(axis, kind)] += times
            sent[(axis, kind)] += num_bytes * times

    weight_bytes = {"fp32": 4, "bf16": 2, "fp16": 2}[precision]
    m, b = s.num_microbatches, rank_batch(s)  # b: one rank's positions, in sequences (b/cp under cp)
    copies, dp_axis = replicas(s), replica_axis(s)
    mine = [i for i in range(len(stages)) if stage_rank(i, s.pp, s.schedule) == pp_rank]
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
                for size in regathered_inputs(unit, b, s, policy):
                    add("tp", "all_gather", size, m)
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
            autocast = runs_autocast(s, precision)  # the residual stream goes over fp32 weights: fp32
            # zbv's V turns at the last rank: two stages there hand their tensors over in place
            same_rank = [stage_rank(i, s.pp, s.schedule) == pp_rank for i in (index - 1, index + 1)]
            if index > 0 and units and not same_rank[0]:
                for tensor in units[0].cut:
                    add("pp", "recv", tensor.bytes_for(b, autocast) / shard, m)  # activations in
                    add("pp", "send", tensor.bytes_for(b, autocast) / shard, m if tensor.grad else 0)  # gradients back
            if index < last and stages[index + 1] and not same_rank[1]:
                for tensor in stages[index + 1][0].cut:
                    add("pp", "send", tensor.bytes_for(b, autocast) / shard, m)
                    add("pp", "recv", tensor.bytes_for(b, autocast) / shard, m if tensor.grad else 0)
        if copies > 1 and s.zero >= 1:
            tied_copies = sum(n for stage, n in tied["copies"] if stage == index)
            moe = experts if s.ep > 1 else ()
            gathered = _fsdp_unit_params(units, s.tp, copies, tied_copies, experts=moe)
            reduced = _fsdp_unit_params(units, s.tp, copies, tied_copies, gradients=True, experts=moe)
            gathers = 2 * m if s.zero >= 3 else 1
            scatters = m if gradients_sharded(s.zero, s.pp) else 1
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
    for size, times in sequence_indexed_gradient_gathers([u for i in mine for u in stages[i]], s):
        add("tp", "all_gather", size, times)
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


def tied_across_ranks(stages: list[list[Unit]], pp: int, tp: int, schedule: str = "1f1b") -> list[dict]:
    """Per pipeline rank: "copies" [(stage index, tp-local elements)] of tied weights it holds
    but another rank owns, and "summed": tp-local elements of tied weights whose gradient it sums
    with other ranks (owner and holders alike)."""
    rank_of_unit = {u.name: stage_rank(i, pp, schedule) for i, units in enumerate(stages) for u in units}
    result = [{"copies": [], "summed": 0.0} for _ in range(pp)]
    seen: set[tuple[str, int]] = set()
    for index, units in enumerate(stages):
        rank = stage_rank(index, pp, schedule)
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


def keeps_shards(unit: Unit, strategy: Strategy, policy: str) -> bool:
    """Whether `unit`'s blocks keep their inputs' sequence shards (`sp_inputs=regathered`): a layer not
    recomputed (a recomputed one keeps what its checkpoint keeps; the head, outside the blocks, keeps
    the input it gathers)."""
    s = strategy
    return s.sp_inputs == "regathered" and s.sp and s.tp > 1 and policy == "none" and unit.layer_type is not None


def regathered_inputs(unit: Unit, batch: float, strategy: Strategy, policy: str) -> list[float]:
    """Bytes of each all-gather `sp_inputs=regathered` adds to `unit`'s backward per micro-batch: each
    block input gathered again from the shard the block kept (`runtime.tensor_parallel.regather`)."""
    if not keeps_shards(unit, strategy, policy):
        return []
    return [op.gathered_bytes * batch for op in unit.forward_ops if op.gathered_bytes]


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
        syncs = s.num_microbatches if gradients_sharded(s.zero, s.pp) else 1
        return [(elements / tensors * GRADIENT_REDUCE_BYTES, tensors * syncs)]
    return [(elements * GRADIENT_REDUCE_BYTES, 1)]


def sequence_indexed_gradient_gathers(units: list[Unit], strategy: Strategy) -> list[tuple[float, int]]:
    """(bytes, calls) gathering the gradients of tables read along the sequence (`Unit.sequence_indexed_params`)
    under sequence parallelism: one all-gather of each table's fp32 gradient whole per gradient sync (once
    a step; under FSDP, at each of its gradient reduce-scatters)."""
    s = strategy
    if s.tp <= 1 or not s.sp:
        return []
    syncs = s.num_microbatches if s.zero >= 1 and gradients_sharded(s.zero, s.pp) else 1
    return [(elements * GRADIENT_REDUCE_BYTES, syncs) for u in units for elements in u.sequence_indexed_params]


def head_vocab(facts, strategy: Strategy) -> int | None:
    """Under tp the runtime runs the head vocabulary-parallel (Megatron's layout): its collectives
    are charged from the vocabulary size (`vocab_parallel_head_collectives`)."""
    return facts.vocab if strategy.tp > 1 else None
