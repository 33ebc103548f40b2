"""The communication ledger: which collectives one training step sends, per mesh axis.

The evaluator prices communication as times; this lists the same traffic as calls and bytes, per
pipeline rank, so a run can be checked against it (`runtime.collectives` counts what executes).
It follows the runtime's algorithm, which the evaluator costs:
- tp: per micro-batch, every partial sum the op graph reduces (an all-reduce; under sequence
  parallelism a reduce-scatter plus an all-gather of the same size), forward and backward; when a
  pipeline's last stage gathers logits sharded over the vocabulary, one all-gather per micro-batch;
  with the loss on vocabulary shards (pp=1), its three small reductions (max, sum of
  exponentials, target logit) per micro-batch;
- tp, full recompute: a layer's forward reductions again, but for the one producing the layer's
  output (its backward needs nothing after it, so recomputation stops before it); under sequence
  parallelism that output's all-gather into the next block is still repeated. Selective
  recompute saves collectives' outputs and repeats none;
- dp, ZeRO 0: the gradients all-reduced once per step in buckets; ZeRO 1-3 (FSDP, one unit per
  layer plus one for the rest of the stage): weights all-gathered at the first forward (ZeRO 1/2)
  or every forward and backward (ZeRO 3), gradients reduce-scattered once per step (ZeRO 1) or per
  micro-batch (ZeRO 2/3);
- pp: a send and a receive per micro-batch and stage boundary, each way; the weights tied across
  pipeline ranks (embedding and head) summed once per step;
- tp, sequence parallel: the gradients of norms (replicated weights that saw sequence shards)
  summed once per step, flattened into one all-reduce; under FSDP (ZeRO 1-3), FSDP sums them
  itself, one all-reduce per tensor at each gradient reduce-scatter;
- world: the global gradient norm (when clipping) and the logged loss, one scalar each (counted
  on an axis that spans the whole world when there is one: it is the same communicator).
Gradients are reduced in fp32 under mixed precision (as FSDP2's reduce dtype and Megatron-LM do).
"""

from __future__ import annotations

import math
from collections import Counter

from autopar.plan import Strategy
from cost_models.facts import Unit

GRADIENT_REDUCE_BYTES = 4  # fp32 gradient reduction, whatever the compute precision
BUCKET_BYTES = 25 * 2**20  # the runtime's zero-0 gradient bucket
SCALAR_BYTES = 4
LOSS_PARALLEL_REDUCTIONS = 3  # max, sum of exponentials, target logit: one value per token each


def step_collectives(stages: list[list[Unit]], strategy: Strategy, precision: str, pp_rank: int, *,
                     seq_len: int, vocab: int | None = None,
                     clip_grad_norm: bool = True) -> dict[tuple[str, str], tuple[int, float]]:
    """{(axis, kind): (calls, bytes)} one step sends on pipeline rank `pp_rank`.

    `stages` are the pp·vp lists of units (stage i on pipeline rank i mod pp).
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
    m, b = s.num_microbatches, s.microbatch
    mine = [i for i in range(len(stages)) if i % s.pp == pp_rank]
    last = len(stages) - 1
    for index in mine:
        units = stages[index]
        if s.tp > 1:
            for unit in units:
                for op in unit.ops:
                    if op.reduce_bytes:
                        size = op.reduce_bytes_for(b)
                        if s.sp:
                            add("tp", "reduce_scatter", size, m)
                            add("tp", "all_gather", size, m)
                        else:
                            add("tp", "all_reduce", size, m)
                    for kind, size in op.collectives:
                        add("tp", kind, size * b, m)
                if s.recompute == "full" and unit.layer_type is not None:
                    for kind, size, times in recomputed_reductions(unit, b, s.sp):
                        add("tp", kind, size, m * times)
            if index == last and vocab:
                activation_bytes = weight_bytes if precision == "fp32" else 4  # logits leave autocast in fp32
                if s.pp > 1:
                    add("tp", "all_gather", b * seq_len * vocab * activation_bytes, m)
                else:  # next-token loss: every position but the last predicts one
                    add("tp", "all_reduce", b * (seq_len - 1) * SCALAR_BYTES, m * LOSS_PARALLEL_REDUCTIONS)
        if s.pp > 1:
            boundary = units[0].input_bytes * b / (s.tp if s.sp else 1) if units else 0.0
            if index > 0:
                add("pp", "recv", boundary, m)  # activations in
                add("pp", "send", boundary, m)  # their gradients back
            if index < last and stages[index + 1]:
                out = stages[index + 1][0].input_bytes * b / (s.tp if s.sp else 1)
                add("pp", "send", out, m)
                add("pp", "recv", out, m)
        if s.dp > 1 and s.zero >= 1:
            copies = sum(n for stage, n in tied["copies"] if stage == index)
            for unit_params in _fsdp_unit_params(units, s.tp, copies):
                gathers = 2 * m if s.zero >= 3 else 1
                scatters = m if s.zero >= 2 else 1
                add("dp", "all_gather", unit_params * weight_bytes, gathers)
                add("dp", "reduce_scatter", unit_params * GRADIENT_REDUCE_BYTES, scatters)
    if s.dp > 1 and s.zero == 0:
        rank_params = sum(u.params_on_device(s.tp) for i in mine for u in stages[i]) + sum(n for _, n in tied["copies"])
        grad_bytes = rank_params * GRADIENT_REDUCE_BYTES
        add("dp", "all_reduce", grad_bytes / max(1, math.ceil(grad_bytes / BUCKET_BYTES)),
            max(1, math.ceil(grad_bytes / BUCKET_BYTES)))
    for size, times in sequence_parallel_gradient_reductions([u for i in mine for u in stages[i]], s):
        add("tp", "all_reduce", size, times)
    if tied["summed"]:  # the local shard of each tied weight, summed over the ranks holding it
        add("pp", "all_reduce", tied["summed"] / (s.dp if s.zero >= 1 else 1) * GRADIENT_REDUCE_BYTES)
    add("world", "all_reduce", SCALAR_BYTES, 2 if clip_grad_norm else 1)
    return {key: (calls[key], sent[key]) for key in sorted(calls)}


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


def _fsdp_unit_params(units: list[Unit], tp: int, root_copies: float = 0.0) -> list[float]:
    """Parameters per FSDP unit of a stage: each layer its own, the rest of the stage the root's."""
    layers = [u.params_on_device(tp) for u in units if u.layer_type is not None]
    root = sum(u.params_on_device(tp) for u in units if u.layer_type is None) + root_copies
    return [p for p in layers if p] + ([root] if root else [])


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


def recomputed_reductions(unit: Unit, batch: int, sp: bool) -> list[tuple[str, float, int]]:
    """(kind, bytes, calls) a full recompute of `unit` repeats per micro-batch."""
    sizes = [op.reduce_bytes_for(batch) for op in unit.forward_ops if op.reduce_bytes]
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
