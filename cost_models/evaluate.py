"""The what-if evaluator: predicted step time, throughput and memory of one strategy.

Pure function of (model facts, cluster, strategy, global batch). Order of a step, as the runtime
executes it: each pipeline stage runs its forward and backward passes per micro-batch (with the
tensor-parallel all-reduces inside them, not overlapped, as in Megatron-LM), ZeRO-3 gathers
weights per micro-batch overlapped with compute, then data-parallel gradient sync overlapped with
the last micro-batch's backward (bucketed), the gradient sum of weights tied across pipeline ranks
(a GPT's embedding and head), then the optimizer step.

`overlap_grad_sync=False` prices a system that starts the data-parallel sync only after the last
backward, as Megatron-LM's 2021 local DDP did (`allreduce_gradients()` after
`forward_backward_func` in megatron/training.py): what its published runs measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from autopar.cluster import ClusterSpec
from autopar.plan import Strategy
from autopar.cost_models.collectives import (GRADIENT_REDUCE_BYTES, recomputed_reductions,
                                     sequence_parallel_gradient_reductions, tied_across_ranks,
                                     vocab_parallel_head_collectives)
from autopar.cost_models.communication import collective_time_s, group_layout
from autopar.cost_models.compute import DEFAULT_EFFICIENCY, Efficiency, UnitTime, unit_time
from autopar.cost_models.facts import ModelFacts, Unit
from autopar.cost_models.memory import (DDP_BUCKET_BYTES, FRAGMENTATION_MARGIN, MemoryBreakdown, device_memory,
                                state_bytes_per_param, usable_bytes)
from autopar.cost_models.pipeline import PipelineResult, estimate, simulate
from autopar.cost_models.recompute import fewest_recomputed_layers, one_more_layer, stage_policies
from autopar.cost_models.strategy import even_stage_layers

# Adam step traffic per parameter: read fp32 master, two moments and the gradient, write master,
# moments and the low-precision weight copy (about 28 bytes either way).
OPTIMIZER_BYTES_PER_PARAM = 28


@dataclass(frozen=True)
class StageCost:
    index: int  # virtual stage
    rank: int  # pipeline rank holding it
    units: tuple[str, ...]
    forward_s: float  # one micro-batch, communication inside included
    backward_s: float
    activation_bytes: float  # one micro-batch's saved activations
    transient_bytes: float  # what recompute rebuilds for the layer being differentiated: once, not per micro-batch
    recomputed_layers: int = 0


@dataclass(frozen=True)
class Evaluation:
    strategy: Strategy
    global_batch: int
    seq_len: int
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    fits: bool
    memory: tuple[MemoryBreakdown, ...]  # per pipeline rank
    breakdown: dict[str, float]
    stages: tuple[StageCost, ...]
    pipeline: PipelineResult | None = field(default=None, repr=False)
    capacity_bytes: float = 0.0
    # Per pipeline rank, one step's busy time with no communication in it (forward, backward,
    # recompute, optimizer): the figure a profiler can check rank by rank.
    rank_compute_s: tuple[float, ...] = ()

    @property
    def peak_memory_bytes(self) -> float:
        return max(m.total_bytes for m in self.memory)


def evaluate(
    facts: ModelFacts,
    cluster: ClusterSpec,
    strategy: Strategy,
    global_batch: int,
    *,
    efficiency: Efficiency = DEFAULT_EFFICIENCY,
    exact: bool = True,
    stages: list[list[Unit]] | None = None,
    vocab: int | None = None,
    recompute_repeats: dict[str, tuple[tuple[str, float], ...]] | None = None,
    overlap_grad_sync: bool = True,
    tp_step: tuple[tuple[str, float], ...] = (),
    selective_repeats: bool = False,
) -> Evaluation:
    """`exact=False` uses the closed-form pipeline estimate (for ranking many candidates);
    `stages` overrides the even split of layers with a searched partition (pp·vp lists of units).
    `vocab` and `recompute_repeats` mean what they mean to `step_collectives` (a head with logits
    sharded over the vocabulary; what full recompute resends under per-parameter placements), so
    a plan's tp communication is priced from the same collectives its ledger lists; so are `tp_step`
    (tp collectives once per step after backward, from a dry run; pp = 1) and `selective_repeats`."""
    s = strategy
    dtype = facts.precision
    gpu = cluster.gpu
    b = s.microbatch
    per = state_bytes_per_param(facts.precision)

    stages_units = stages if stages is not None else partition(facts, s.pp * s.vp)
    if len(stages_units) != s.pp * s.vp:
        raise ValueError(f"{len(stages_units)} stages given for pp×vp = {s.pp * s.vp}")

    def timed(unit: Unit) -> UnitTime:
        key = ("time", gpu.name, dtype, b, s.tp, s.sp, efficiency)
        if key not in unit.memo:
            unit.memo[key] = unit_time(unit, gpu, dtype, batch=b, tp=s.tp, sp=s.sp, efficiency=efficiency)
        return unit.memo[key]

    tp_layout = group_layout(s.tp, 1, cluster.gpus_per_node)
    dp_layout = group_layout(s.dp, s.tp, cluster.gpus_per_node)
    pp_layout = group_layout(s.pp, s.dp * s.tp, cluster.gpus_per_node)

    def reduce_time(total_bytes: float, count: int, others: tuple[tuple[str, float], ...] = ()) -> float:
        if s.tp == 1:
            return 0.0
        reduces = count * collective_time_s("all_reduce", total_bytes / count, tp_layout, cluster) if count else 0.0
        return reduces + sum(collective_time_s(kind, size, tp_layout, cluster) for kind, size in others)

    # What one unit adds to its stage under a recompute policy. Layer instances repeat, so it is
    # kept on the unit for the quick ranking's thousands of calls (not with `recompute_repeats`,
    # which differ per plan).
    part_keys = {policy: _interned(("part", gpu.name, dtype, b, s.tp, s.sp, policy, efficiency,
                                    cluster.gpus_per_node, cluster.intra_node, cluster.inter_node))
                 for policy in {"none", s.recompute}}

    def unit_part(unit: Unit, policy: str) -> tuple[float, ...]:
        part_key = part_keys[policy]
        if recompute_repeats is None and part_key in unit.memo:
            return unit.memo[part_key]
        t = timed(unit)
        forward_comm = reduce_time(t.forward_reduce_bytes, t.forward_reduces, t.forward_collectives)
        backward_comm = reduce_time(t.backward_reduce_bytes, t.backward_reduces, t.backward_collectives)
        full = unit_activation_bytes(unit, b, s.tp, s.sp, "none")
        recompute_extra = largest_full_layer = 0.0
        if policy == "full":
            repeated = [] if s.tp == 1 else recomputed_reductions(unit, b, s.sp) if recompute_repeats is None \
                else [(kind, size * b, 1) for kind, size in recompute_repeats.get(unit.name, ())]
            recompute_extra = t.forward_s + sum(times * collective_time_s(kind, size, tp_layout, cluster)
                                                for kind, size, times in repeated)
            largest_full_layer = full
        elif policy == "selective":
            recompute_extra = t.forward_vector_s
            if selective_repeats and recompute_repeats and s.tp > 1:
                recompute_extra += sum(collective_time_s(kind, size * b, tp_layout, cluster)
                                       for kind, size in recompute_repeats.get(unit.name, ()))
            largest_full_layer = full - unit_activation_bytes(unit, b, s.tp, s.sp, "selective")
        part = (t.forward_s, t.backward_s, forward_comm, backward_comm, recompute_extra, largest_full_layer,
                unit_activation_bytes(unit, b, s.tp, s.sp, policy), unit.params_on_device(s.tp))
        if recompute_repeats is None:
            unit.memo[part_key] = part
        return part

    stage_costs: list[StageCost] = []
    compute_parts: list[tuple[float, float, float]] = []  # (compute, recompute, tp comm) per micro-batch
    rank_params = [0.0] * s.pp
    rank_largest_unit = [0.0] * s.pp
    for index, units in enumerate(stages_units):
        rank = index % s.pp
        forward = backward = 0.0
        forward_comm = backward_comm = 0.0
        activations = 0.0
        recompute_extra = 0.0
        largest_full_layer = 0.0
        policies = stage_policies(units, s, index)
        for unit, policy in zip(units, policies):
            (unit_forward, unit_backward, unit_forward_comm, unit_backward_comm, unit_recompute, unit_full,
             unit_activations, on_device) = unit_part(unit, policy)
            forward += unit_forward
            backward += unit_backward
            forward_comm += unit_forward_comm
            backward_comm += unit_backward_comm
            recompute_extra += unit_recompute
            largest_full_layer = max(largest_full_layer, unit_full)
            activations += unit_activations
            rank_params[rank] += on_device
            rank_largest_unit[rank] = max(rank_largest_unit[rank], on_device)
        if vocab and s.tp > 1 and index == len(stages_units) - 1:
            forward_comm += sum(times * collective_time_s(kind, size, tp_layout, cluster)
                                for kind, size, times in vocab_parallel_head_collectives(s, dtype, facts.seq_len, vocab))
        zero3_forward = zero3_backward = 0.0
        if s.zero >= 3 and s.dp > 1:
            stage_weight_bytes = sum(u.params_on_device(s.tp) for u in units) * per.weight
            gather = collective_time_s("all_gather", stage_weight_bytes, dp_layout, cluster)
            scatter = collective_time_s("reduce_scatter", stage_weight_bytes / per.weight * GRADIENT_REDUCE_BYTES,
                                        dp_layout, cluster)
            first = gather / max(len(units), 1)
            zero3_forward = max(gather - forward, first)
            zero3_backward = max(gather + scatter - backward, first)
        f = forward + forward_comm + zero3_forward
        bw = backward + backward_comm + recompute_extra + zero3_backward
        stage_costs.append(StageCost(index, rank, tuple(u.name for u in units), f, bw, activations, largest_full_layer,
                                     sum(policy != "none" for policy in policies)))
        compute_parts.append((forward + backward, recompute_extra,
                              forward_comm + backward_comm + zero3_forward + zero3_backward))

    tied_ranks = tied_across_ranks(stages_units, s.pp, s.tp)
    for rank, tied in enumerate(tied_ranks):
        rank_params[rank] += sum(elements for _, elements in tied["copies"])  # a tied head's copy of the embedding
    # first and last pipeline ranks: `pp - 1` rank strides apart
    tied_layout = group_layout(2, s.dp * s.tp * max(s.pp - 1, 1), cluster.gpus_per_node)

    boundary_bytes = max((u[0].input_bytes for u in stages_units[1:] if u), default=0.0) * b / (s.tp if s.sp else 1)
    p2p = collective_time_s("send_recv", boundary_bytes, pp_layout, cluster) if s.pp > 1 else 0.0
    pipe = (simulate if exact else estimate)(
        [c.forward_s for c in stage_costs], [c.backward_s for c in stage_costs], s.num_microbatches, s.schedule,
        pp=s.pp, vp=s.vp, p2p_s=p2p, stage_weight=[c.activation_bytes for c in stage_costs],
    )

    # Data-parallel gradient sync after the last micro-batch, and the optimizer step.
    rank_stages = [range(rank, len(stage_costs), s.pp) for rank in range(s.pp)]  # virtual stage i runs on i % pp
    rank_finish = []
    dp_exposed = []
    optimizer = []
    for rank in range(s.pp):
        grad_bytes = rank_params[rank] * GRADIENT_REDUCE_BYTES
        exposed = 0.0
        if s.dp > 1 and s.zero < 3:
            reduce = collective_time_s("reduce_scatter" if s.zero >= 1 else "all_reduce", grad_bytes, dp_layout, cluster)
            window = sum(stage_costs[i].backward_s for i in rank_stages[rank])
            buckets = max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES))
            exposed = max(reduce - window, reduce / buckets) if overlap_grad_sync else reduce
            if s.zero >= 1:  # updated weight shards are gathered after the step: nothing to hide it behind
                exposed += collective_time_s("all_gather", rank_params[rank] * per.weight, dp_layout, cluster)
        rank_units = [u for i in rank_stages[rank] for u in stages_units[i]]
        exposed += sum(calls * collective_time_s("all_reduce", size, tp_layout, cluster)
                       for size, calls in sequence_parallel_gradient_reductions(rank_units, s))
        if s.tp > 1:
            exposed += sum(collective_time_s(kind, size, tp_layout, cluster) for kind, size in tp_step)
        if tied_ranks[rank]["summed"]:  # as the ledger sends it: after backward, nothing to hide behind
            tied_bytes = tied_ranks[rank]["summed"] / (s.dp if s.zero >= 1 else 1) * GRADIENT_REDUCE_BYTES
            exposed += collective_time_s("all_reduce", tied_bytes, tied_layout, cluster)
        updated = rank_params[rank] / (s.dp if s.zero >= 1 else 1)
        step = updated * OPTIMIZER_BYTES_PER_PARAM / (gpu.hbm_bandwidth_bytes_per_s * efficiency.memory)
        dp_exposed.append(exposed)
        optimizer.append(step)
        rank_finish.append(pipe.rank_end_s[rank] + exposed + step)
    step_time = max(rank_finish)
    critical = rank_finish.index(step_time)

    memory = tuple(
        device_memory(
            params_on_device=rank_params[rank], largest_unit_params=rank_largest_unit[rank],
            precision=facts.precision, zero=s.zero, dp=s.dp,
            activation_bytes=pipe.peak_in_flight[rank]
            + max(stage_costs[i].transient_bytes for i in rank_stages[rank]),
        )
        for rank in range(s.pp)
    )
    capacity = usable_bytes(gpu.memory_bytes)
    fits = all(m.total_bytes <= capacity for m in memory)

    tokens = global_batch * facts.seq_len
    model_flops = facts.flops_per_sample * global_batch  # no recompute
    world = s.dp * s.tp * s.pp
    tflops_per_gpu = model_flops / step_time / world / 1e12
    critical_stages = rank_stages[critical]
    m = s.num_microbatches
    rank_compute = tuple(
        m * sum(compute_parts[i][0] + compute_parts[i][1] for i in rank_stages[rank])
        + optimizer[rank] for rank in range(s.pp))
    compute = m * sum(compute_parts[i][0] for i in critical_stages)
    recompute = m * sum(compute_parts[i][1] for i in critical_stages)
    tp_comm = m * sum(compute_parts[i][2] for i in critical_stages)
    bubble = max(pipe.rank_end_s[critical] - pipe.rank_busy_s[critical], 0.0)
    breakdown = {
        "compute": compute,
        "recompute": recompute,
        "exposed_communication": tp_comm + dp_exposed[critical],
        "bubble": bubble,
        "optimizer": optimizer[critical],
    }
    return Evaluation(
        strategy=s, global_batch=global_batch, seq_len=facts.seq_len, step_time_s=step_time,
        tokens_per_s=tokens / step_time, tflops_per_gpu=tflops_per_gpu,
        mfu=tflops_per_gpu * 1e12 / gpu.peak_flops_per_s(dtype), fits=fits, memory=memory,
        breakdown=breakdown, stages=tuple(stage_costs), pipeline=pipe,
        capacity_bytes=capacity, rank_compute_s=rank_compute,
    )


def with_fewest_recomputed_layers(evaluation: Evaluation, stages: list[list[Unit]],
                                  rerun: Callable[[Strategy], Evaluation]) -> Evaluation:
    """`evaluation` (every layer recomputing) redone with each stage recomputing only the layers
    its rank needs to fit, when that is faster. `rerun(strategy)` evaluates a strategy on the
    same stages. The counts come from the memory model (`fewest_recomputed_layers`); a rank the
    re-evaluation still finds over capacity gets one more layer per chunk, a few times."""
    s = evaluation.strategy
    if s.recompute == "none" or s.recompute_layers is not None or not evaluation.fits:
        return evaluation
    b, tp, sp = s.microbatch, s.tp, s.sp

    def keeps(unit: Unit) -> float:
        return unit_activation_bytes(unit, b, tp, sp, "none") - unit_activation_bytes(unit, b, tp, sp, s.recompute)

    def transient(unit: Unit) -> float:
        full = unit_activation_bytes(unit, b, tp, sp, "none")
        return full if s.recompute == "full" else keeps(unit)

    counts = fewest_recomputed_layers(
        strategy=s, stages=stages, total_bytes=[m.total_bytes for m in evaluation.memory],
        activation_bytes=[m.activations for m in evaluation.memory],
        stage_activation_bytes=[c.activation_bytes for c in evaluation.stages],
        margin_ratio=1 + FRAGMENTATION_MARGIN, capacity_bytes=evaluation.capacity_bytes,
        keeps_bytes=keeps, transient_bytes=transient)
    layers = [sum(1 for u in units if u.layer_type is not None) for units in stages]
    for _ in range(4):
        if counts is None or list(counts) == layers or not any(counts):
            return evaluation  # none at all is the strategy without recompute, evaluated on its own
        trial = rerun(s.model_copy(update={"recompute_layers": counts}))
        if trial.fits:
            return trial if trial.step_time_s <= evaluation.step_time_s else evaluation
        full_ranks = {r for r, m in enumerate(trial.memory) if m.total_bytes > trial.capacity_bytes}
        counts = one_more_layer(counts, layers, s.pp, full_ranks)
    return evaluation


_KEYS: dict[tuple, tuple[str, int]] = {}


def _interned(key: tuple) -> tuple[str, int]:
    """A cheap stand-in for a memo key whose parts (pydantic links, dataclasses) hash slowly."""
    return _KEYS.setdefault(key, ("interned", len(_KEYS)))


def partition(facts: ModelFacts, stages: int) -> list[list[Unit]]:
    """Layers split evenly over stages (extra layers to the middle stages); the units before the
    first layer join stage 0, those after a layer join that layer's stage."""
    units = list(facts.units)
    layer_positions = [i for i, u in enumerate(units) if u.layer_type is not None]
    sizes = even_stage_layers(len(layer_positions), stages)
    stage_of_layer: dict[int, int] = {}
    position = 0
    for stage, size in enumerate(sizes):
        for _ in range(size):
            stage_of_layer[layer_positions[position]] = stage
            position += 1
    result: list[list[Unit]] = [[] for _ in range(stages)]
    current = 0
    for i, unit in enumerate(units):
        if i in stage_of_layer:
            current = stage_of_layer[i]
        result[current].append(unit)
    return result


def unit_activation_bytes(unit: Unit, batch: int, tp: int, sp: bool, recompute: str) -> float:
    """Bytes a unit keeps from forward to backward for one micro-batch on one tp rank."""
    key = ("activations", batch, tp, sp, recompute)
    if key not in unit.memo:
        unit.memo[key] = _activation_bytes(unit, batch, tp, sp, recompute)
    return unit.memo[key]


def _activation_bytes(unit: Unit, batch: int, tp: int, sp: bool, recompute: str) -> float:
    if recompute == "full":
        return unit.input_bytes * batch / (tp if sp else 1)
    total = 0.0
    for op in unit.forward_ops:
        if not op.saved_bytes:
            continue
        if recompute == "selective" and op.kind == "vector":
            continue
        total += op.saved_bytes * batch / (tp if (op.saved_sharded or sp) else 1)
    if recompute == "selective":
        total += unit.input_bytes * batch / (tp if sp else 1)
    return total
