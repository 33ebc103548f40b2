"""The what-if evaluator: predicted step time, throughput and memory of one strategy.

Pure function of (model facts, cluster, strategy, global batch). Order of a step, as the runtime
executes it: each pipeline stage runs its forward and backward passes per micro-batch (with the
tensor-parallel all-reduces inside them, not overlapped, as in Megatron-LM), ZeRO-3 gathers
weights per micro-batch overlapped with compute, then data-parallel gradient sync overlapped with
the last micro-batch's backward (bucketed), the gradient sum of weights tied across pipeline ranks
(a GPT's embedding and head), then the optimizer step.

The strategy's implementation profile (`cost_models.implementation`) prices other software as it
ran: `dp_overlap=False` starts the data-parallel sync only after the last backward, as
Megatron-LM's 2021 local DDP did (`allreduce_gradients()` after `forward_backward_func` in
megatron/training.py), what its published runs measured (`overlap_grad_sync=False` does the same
whatever the strategy says).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

from autopar.cluster import ClusterSpec
from autopar.plan_schema import Strategy, rank_stage_indices
from autopar.cost_models.collectives import (GRADIENT_REDUCE_BYTES, sequence_indexed_gradient_gathers,
                                             sequence_parallel_gradient_reductions,
                                             tied_across_ranks)
from autopar.cost_models.communication import collective_time_s, group_layout
from autopar.cost_models.backward_memory import (backward_working_bytes, compiled_loss_saving_bytes,
                                                head_gradient_bytes, loss_unit, stage_backward_bytes)
from autopar.cost_models.compiled_stage import compiled_layers
from autopar.cost_models.compute import DEFAULT_EFFICIENCY, Efficiency
from autopar.cost_models.context import exchange_buffer_bytes, rank_batch, replicas, sync_layout
from autopar.cost_models.experts import dispatch_buffer_bytes, replica_layout
from autopar.cost_models.facts import ModelFacts, Unit
from autopar.cost_models.implementation import as_run
from autopar.cost_models.memory import (DDP_BUCKET_BYTES, FRAGMENTATION_MARGIN, LossLayout, MemoryBreakdown,
                                        activation_scale, device_memory, fragmentation,
                                        planning_capacity_bytes, state_bytes_per_param)
from autopar.cost_models.offload import OffloadCost, host_capacity_bytes, node_host_bytes, offload_cost
from autopar.cost_models.pipeline import PipelineResult, estimate, simulate
from autopar.cost_models.recompute import first_layers_policies, fewest_recomputed_layers, one_more_layer
from autopar.cost_models.stage_costs import (CostCache, Pricing, StageCost, StagePrices, autocast_activations,
                                             price_stages, unit_kept_bytes)
from autopar.cost_models.optimizer import step_bytes_per_param
from autopar.cost_models.strategy import even_stage_layers

def optimizer_step_bytes(optimizer_state: str, implementation: str = "fused") -> float:
    """HBM traffic of one Adam step and the gradient clipping before it, per parameter
    (`cost_models.optimizer`: counted in torch's kernels)."""
    return step_bytes_per_param(implementation, optimizer_state)


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
    capacity_bytes: float = 0.0  # what the plan may use: usable memory less the headroom
    headroom_bytes: float = 0.0  # memory the planner leaves free beyond the model's margins (cluster.memory_headroom)
    # Per pipeline rank, one step's busy time with no communication in it (forward, backward,
    # recompute, optimizer): the figure a profiler can check rank by rank.
    rank_compute_s: tuple[float, ...] = ()
    # offload=optimizer: the fullest node's host memory (optimizer shards of its GPUs) and what a plan
    # may place there (`cost_models.offload`); 0 without offload.
    host_memory_bytes: float = 0.0
    host_capacity_bytes: float = 0.0
    # Device bytes per activation byte priced (`memory.activation_scale`): what recompute counts save.
    activation_scale: float = 1 + FRAGMENTATION_MARGIN
    # Whether the activations were counted at autocast's dtypes (`stage_costs.autocast_activations`).
    autocast_activations: bool = False
    # Whether a block's input was counted cast once for its projections (`Pricing.block_casts_once`).
    block_casts_once: bool = False
    # Per pipeline rank, the loss's gradients at the head (`rank_head_bytes`), and the unit holding the
    # loss (`loss_unit`): what `with_fewest_recomputed_layers` re-prices a rank's backward with.
    rank_head_bytes: tuple[float, ...] = ()
    loss_unit: str | None = None
    # Each stage's units as priced (`priced_stages`: the attention and dropout the plan runs).
    priced_units: tuple[tuple[Unit, ...], ...] = field(default=(), repr=False, compare=False)

    @property
    def fits_host(self) -> bool:
        return self.host_memory_bytes <= self.host_capacity_bytes

    @property
    def peak_memory_bytes(self) -> float:
        return max(m.total_bytes for m in self.memory)


@dataclass(frozen=True)
class RankTail:
    """What a pipeline rank does after its last backward: the data-parallel sync it cannot hide,
    and the optimizer step."""

    exposed_comm_s: float
    optimizer_s: float  # on the device, or on the CPU under offload=optimizer
    offload: OffloadCost | None = None  # offload=optimizer: the PCIe copies and the host's share

    @property
    def offload_transfer_s(self) -> float:
        return self.offload.exposed_transfer_s if self.offload is not None else 0.0


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
    cache: CostCache | None = None,
    tp_step: tuple[tuple[str, float], ...] = (),
    selective_repeats: bool = False,
    tp_realization: str | None = None,
    vocab_parallel_loss: bool | None = None,
) -> Evaluation:
    """`exact=False` uses the closed-form pipeline estimate (for ranking many candidates);
    `stages` overrides the even split of layers with a searched partition (pp·vp lists of units).
    `vocab` and `recompute_repeats` mean what they mean to `step_collectives` (a head with logits
    sharded over the vocabulary; what full recompute resends under per-parameter placements), so
    a plan's tp communication is priced from the same collectives its ledger lists; so are `tp_step`
    (tp collectives once per step after backward, from a dry run; pp = 1) and `selective_repeats`.
    `cache`: the caller's, to share derived unit costs across evaluations of one model (a fresh one
    if None). `tp_realization`: how the runtime realizes tp > 1 (`Plan.tp_realization`): the module
    rules cast a block's input once for its projections; None (not known) or DTensor, once each.
    `vocab_parallel_loss`: whether the head's logits come out sharded over the vocabulary, where the
    collectives are a dry run's and `vocab` is not given (None: where `vocab` is, `LossLayout.of`)."""
    s = strategy
    facts, stages_units = priced_stages(facts, s, stages)
    pricing = pricing_for(facts, cluster, s, efficiency=efficiency, cache=cache, vocab=vocab,
                          recompute_repeats=recompute_repeats, tp_step=tp_step, selective_repeats=selective_repeats,
                          tp_realization=tp_realization)
    prices = price_stages(pricing, stages_units)
    tied_ranks = tied_across_ranks(stages_units, s.pp, s.tp, s.schedule)
    rank_params = list(prices.rank_params)
    for rank, tied in enumerate(tied_ranks):
        rank_params[rank] += sum(elements for _, elements in tied["copies"])  # a tied head's copy of the embedding
    pipe = run_pipeline(pricing, prices, stages_units, exact)
    tails = rank_tails(pricing, prices, stages_units, rank_params, tied_ranks, overlap_grad_sync and s.dp_overlap)
    head_bytes = rank_head_bytes(pricing, len(stages_units), LossLayout.of(s, vocab, vocab_parallel_loss))
    memory = rank_memory(pricing, prices, pipe, rank_params, stages_units, head_bytes)
    return dataclasses.replace(summarize(pricing, global_batch, prices, pipe, tails, memory),
                               rank_head_bytes=head_bytes, loss_unit=loss_unit(pricing.facts),
                               priced_units=tuple(tuple(units) for units in stages_units))


def pricing_for(facts: ModelFacts, cluster: ClusterSpec, s: Strategy, *, efficiency: Efficiency = DEFAULT_EFFICIENCY,
                cache: CostCache | None = None, vocab: int | None = None,
                recompute_repeats: dict[str, tuple[tuple[str, float], ...]] | None = None,
                tp_step: tuple[tuple[str, float], ...] = (), selective_repeats: bool = False,
                tp_realization: str | None = None) -> Pricing:
    """What one evaluation of `s` shares (`Pricing`); the options mean what they mean to `evaluate`."""
    return Pricing(facts=facts, cluster=cluster, strategy=s, efficiency=efficiency, cache=cache or CostCache(),
                   tp_layout=group_layout(s.tp, 1, cluster.gpus_per_node),
                   dp_layout=sync_layout(s, cluster.gpus_per_node), vocab=vocab,
                   recompute_repeats=recompute_repeats, tp_step=tp_step, selective_repeats=selective_repeats,
                   block_casts_once=s.tp > 1 and tp_realization == "modules")


def priced_stages(facts: ModelFacts, s: Strategy, stages: list[list[Unit]] | None
                  ) -> tuple[ModelFacts, list[list[Unit]]]:
    """The facts as the strategy's implementation profile runs them, and the stages' units from them
    (the caller's stages, or the even split)."""
    implemented = as_run(facts, s.attention, s.dropout)
    if implemented is not facts and stages is not None:  # the caller's stages, as the profile runs them
        by_name = {unit.name: unit for unit in implemented.units}
        stages = [[by_name.get(unit.name, unit) for unit in units] for units in stages]
    stages_units = stages if stages is not None else partition(implemented, s.pp * s.vp)
    if len(stages_units) != s.pp * s.vp:
        raise ValueError(f"{len(stages_units)} stages given for pp×vp = {s.pp * s.vp}")
    return implemented, stages_units


def run_pipeline(pricing: Pricing, prices: StagePrices, stages_units: list[list[Unit]], exact: bool) -> PipelineResult:
    """The schedule of every micro-batch's passes, with the point-to-point transfers between stages:
    what crosses a stage boundary (`Unit.cut`, divided over tp under sp) sent over the link between the two
    stages' ranks (the network once pp's stride leaves the node), at that link's bandwidth plus a
    step of its latency; a transfer delays the pass that needs it, not the rank that sends."""
    s = pricing.strategy
    p2p = stage_transfer_s(s, pricing.cluster, stages_units, pricing.autocast_runs())
    stage_costs = prices.stages
    return (simulate if exact else estimate)(
        [c.forward_s for c in stage_costs], [c.backward_s for c in stage_costs], s.num_microbatches, s.schedule,
        pp=s.pp, vp=s.vp, p2p_s=p2p, stage_weight=[c.activation_bytes for c in stage_costs],
        weight_s=[c.backward_weight_s for c in stage_costs],
    )


def stage_transfer_s(s: Strategy, cluster: ClusterSpec, stages_units: list[list[Unit]],
                     autocast: bool | None = None) -> float:
    """One point-to-point transfer between pipeline stages: the largest boundary's bytes over the pp link;
    `autocast`: at autocast's dtypes, as the runtime sends them over fp32 weights (`CutTensor.autocast_bytes`),
    or as traced; None: the smaller of the two, the floor `cost_models.bounds` takes."""
    if s.pp == 1:
        return 0.0
    pp_layout = group_layout(s.pp, s.dp * s.cp * s.tp, cluster.gpus_per_node)
    batch = rank_batch(s)
    boundary_bytes = max((sum(t.bytes_for(batch, autocast) for t in u[0].cut) for u in stages_units[1:] if u),
                         default=0.0) \
        / (s.tp if s.sp else 1)
    return collective_time_s("send_recv", boundary_bytes, pp_layout, cluster)


def rank_stages(strategy: Strategy, stages: int) -> list[range]:
    """The virtual stages each pipeline rank runs: stage i runs on rank i % pp (zbv: `plan_schema.stage_rank`)."""
    if strategy.schedule == "zbv":
        return rank_stage_indices(strategy.pp, stages, strategy.schedule)
    return [range(rank, stages, strategy.pp) for rank in range(strategy.pp)]


def rank_tails(pricing: Pricing, prices: StagePrices, stages_units: list[list[Unit]], rank_params: list[float],
               tied_ranks: list[dict], overlap_grad_sync: bool) -> list[RankTail]:
    """Per pipeline rank: the data-parallel gradient sync left after the last micro-batch's backward
    (bucketed, overlapped with that backward unless `overlap_grad_sync` is False), the sums of
    sequence-parallel norm gradients and tied weights, and the optimizer step."""
    s, cluster, efficiency = pricing.strategy, pricing.cluster, pricing.efficiency
    per = state_bytes_per_param(pricing.facts.precision, s.optimizer_state)
    dp_layout, tp_layout = pricing.dp_layout, pricing.tp_layout
    # first and last pipeline ranks: `pp - 1` rank strides apart
    tied_layout = group_layout(2, s.dp * s.cp * s.tp * max(s.pp - 1, 1), cluster.gpus_per_node)
    copies = replicas(s)  # ranks holding the same weights: gradients reduce, and ZeRO shards, over them
    tails = []
    for rank, stage_indices in enumerate(rank_stages(s, len(prices.stages))):
        experts = prices.rank_expert_params[rank] if prices.rank_expert_params else 0.0
        grad_bytes = (rank_params[rank] - experts) * GRADIENT_REDUCE_BYTES  # experts: over their replicas below
        exposed = 0.0
        # ZeRO 3 reduces inside each backward (`stage_costs._zero3_exposed_s`), under pp after the last
        reduced_after = s.zero < 3 or s.pp > 1
        if copies > 1 and reduced_after:
            reduce = collective_time_s("reduce_scatter" if s.zero >= 1 else "all_reduce", grad_bytes, dp_layout, cluster)
            window = sum(prices.stages[i].backward_s for i in stage_indices)
            buckets = max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES))
            exposed = max(reduce - window, reduce / buckets) if overlap_grad_sync else reduce
            if 1 <= s.zero < 3:  # the updated weight shards, gathered before (or during) the next forward
                gather = collective_time_s("all_gather", (rank_params[rank] - experts) * per.weight, dp_layout,
                                           cluster)
                first_forward = sum(prices.stages[i].forward_s for i in stage_indices)
                exposed += max(gather - first_forward, gather / buckets) if overlap_grad_sync else gather
        if experts and s.dp > s.ep and reduced_after:  # expert gradients over the dp/ep ranks holding the same experts
            expert_replicas = replica_layout(s, cluster.gpus_per_node)
            reduce = collective_time_s("reduce_scatter" if s.zero >= 1 else "all_reduce",
                                       experts * GRADIENT_REDUCE_BYTES, expert_replicas, cluster)
            window = sum(prices.stages[i].backward_s for i in stage_indices)
            buckets = max(1, math.ceil(experts * GRADIENT_REDUCE_BYTES / DDP_BUCKET_BYTES))
            exposed += max(reduce - window, reduce / buckets) if overlap_grad_sync else reduce
            if 1 <= s.zero < 3:  # and their updated shards gathered again
                gather = collective_time_s("all_gather", experts * per.weight, expert_replicas, cluster)
                first_forward = sum(prices.stages[i].forward_s for i in stage_indices)
                exposed += max(gather - first_forward, gather / buckets) if overlap_grad_sync else gather
        rank_units = [u for i in stage_indices for u in stages_units[i]]
        exposed += sum(calls * collective_time_s("all_reduce", size, tp_layout, cluster)
                       for size, calls in sequence_parallel_gradient_reductions(rank_units, s))
        exposed += sum(calls * collective_time_s("all_gather", size, tp_layout, cluster)
                       for size, calls in sequence_indexed_gradient_gathers(rank_units, s))
        if s.tp > 1:
            exposed += sum(collective_time_s(kind, size, tp_layout, cluster) for kind, size in pricing.tp_step)
        if tied_ranks[rank]["summed"]:  # as the ledger sends it: after backward, nothing to hide behind
            tied_bytes = tied_ranks[rank]["summed"] / (copies if s.zero >= 1 else 1) * GRADIENT_REDUCE_BYTES
            exposed += collective_time_s("all_reduce", tied_bytes, tied_layout, cluster)
        # ZeRO shards dense states over dp (x cp), expert slices over their dp/ep replicas
        updated = (rank_params[rank] - experts) / (copies if s.zero >= 1 else 1) \
            + experts / (s.dp // s.ep if s.zero >= 1 else 1)
        if s.offload == "optimizer":
            units = sum(1 for i in stage_indices for u in stages_units[i] if u.layer_type is not None) + 1
            offload = offload_cost(updated, cluster, zero=s.zero, num_microbatches=s.num_microbatches,
                                   forward_s=sum(prices.stages[i].forward_s for i in stage_indices),
                                   backward_s=sum(prices.stages[i].backward_s for i in stage_indices),
                                   units=units, optimizer_state=s.optimizer_state)
            tails.append(RankTail(exposed, offload.cpu_step_s, offload))
            continue
        step = updated * optimizer_step_bytes(s.optimizer_state, s.optimizer_impl) / (cluster.gpu.hbm_bandwidth_bytes_per_s
                                                                      * efficiency.memory)
        tails.append(RankTail(exposed, step))
    return tails


def rank_memory(pricing: Pricing, prices: StagePrices, pipe: PipelineResult, rank_params: list[float],
                stages_units: list[list[Unit]], head_bytes: Sequence[float]) -> tuple[MemoryBreakdown, ...]:
    """Each pipeline rank's peak: model states, the micro-batches it holds at its peak, what
    recompute rebuilds for the layer being differentiated, under ep the all-to-all buffers, under cp
    the attention exchange's (`context.exchange_buffer_bytes`), the larger of the loss's gradients
    (`head_bytes`, `rank_head_bytes`) and a unit's backward (`backward_working_bytes`: its working set
    beside what recompute rebuilds for it); ZeRO shards over dp × cp."""
    s = pricing.strategy
    return tuple(
        device_memory(
            params_on_device=rank_params[rank], largest_unit_params=prices.rank_largest_unit_params[rank],
            precision=pricing.facts.precision, zero=s.zero, dp=replicas(s),
            activation_bytes=pipe.peak_in_flight[rank]
            + max(prices.stages[i].transient_bytes for i in stage_indices)
            - (compiled_loss_saving_bytes(pricing.facts, s) if len(prices.stages) - 1 in stage_indices else 0.0),
            optimizer_state=s.optimizer_state, offload=s.offload,
            dispatch_bytes=dispatch_buffer_bytes(pricing.facts.experts, [u.name for i in stage_indices
                                                                          for u in stages_units[i]], s.microbatch)
            if s.ep > 1 else 0.0,
            expert_params=prices.rank_expert_params[rank] if prices.rank_expert_params else 0.0,
            expert_dp=s.dp // s.ep,
            exchange_bytes=exchange_buffer_bytes(pricing.facts.attention, [u.name for i in stage_indices
                                                                            for u in stages_units[i]], s)
            if s.cp > 1 else 0.0,
            num_microbatches=s.num_microbatches, optimizer_impl=s.optimizer_impl, pp=s.pp,
            compiled=compiled_layers(s), autocast_counted=autocast_activations(pricing),
            # the loss's gradients (live before any layer recomputes) or a unit's backward (its
            # gradients in flight, a fresh gradient, what recompute rebuilds for it): the larger, beyond
            # the rank's largest transient (counted in its activations)
            loss_bytes=max(0.0, max(head_bytes[rank],
                                    max(backward_working_bytes(pricing, stages_units[i], i) for i in stage_indices))
                           - max(prices.stages[i].transient_bytes for i in stage_indices)),
        )
        for rank, stage_indices in enumerate(rank_stages(s, len(prices.stages)))
    )


def rank_head_bytes(pricing: Pricing, stages: int, loss: LossLayout | None = None) -> tuple[float, ...]:
    """Per pipeline rank, the loss's gradients at the head (`head_gradient_bytes`): the last stage's rank's."""
    s = pricing.strategy
    return tuple(head_gradient_bytes(pricing.facts, s, loss) if stages - 1 in stage_indices else 0.0
                 for stage_indices in rank_stages(s, stages))


def stage_working_bytes(facts: ModelFacts, cluster: ClusterSpec, strategy: Strategy) -> list[float]:
    """Each stage's `backward_working_bytes` under the even split and `evaluate`'s defaults."""
    s = strategy
    facts, stages_units = priced_stages(facts, s, None)
    pricing = pricing_for(facts, cluster, s)
    return [backward_working_bytes(pricing, units, index) for index, units in enumerate(stages_units)]


def summarize(pricing: Pricing, global_batch: int, prices: StagePrices, pipe: PipelineResult,
              tails: list[RankTail], memory: tuple[MemoryBreakdown, ...]) -> Evaluation:
    """Step time (the slowest rank's finish), throughput, fit, and the critical rank's breakdown."""
    s, facts, gpu = pricing.strategy, pricing.facts, pricing.cluster.gpu
    rank_finish = [pipe.rank_end_s[rank] + tail.exposed_comm_s + tail.offload_transfer_s + tail.optimizer_s
                   for rank, tail in enumerate(tails)]
    step_time = max(rank_finish)
    critical = rank_finish.index(step_time)
    capacity = planning_capacity_bytes(gpu.memory_bytes, pricing.cluster.memory_headroom)
    headroom = planning_capacity_bytes(gpu.memory_bytes, 0.0) - capacity
    tokens = global_batch * facts.seq_len
    model_flops = facts.flops_per_sample * global_batch  # no recompute
    tflops_per_gpu = model_flops / step_time / (s.dp * s.cp * s.tp * s.pp) / 1e12
    stages_of = rank_stages(s, len(prices.stages))
    m = s.num_microbatches
    rank_compute = tuple(m * sum(prices.compute_s[i] + prices.recompute_s[i] for i in stages_of[rank])
                         + tails[rank].optimizer_s for rank in range(s.pp))
    critical_stages = stages_of[critical]
    breakdown = {
        "compute": m * sum(prices.compute_s[i] for i in critical_stages),
        "recompute": m * sum(prices.recompute_s[i] for i in critical_stages),
        "exposed_communication": m * sum(prices.tp_comm_s[i] for i in critical_stages)
        + tails[critical].exposed_comm_s,
        "bubble": max(pipe.rank_end_s[critical] - pipe.rank_busy_s[critical], 0.0),
        "optimizer": tails[critical].optimizer_s,
    }
    if s.ep > 1:  # the MoE all-to-alls, exposed inside the passes
        breakdown["expert_all_to_all"] = m * sum(prices.ep_comm_s[i] for i in critical_stages)
    if s.cp > 1:  # the attention exchange (ring p2p, ulysses all-to-all) left exposed inside the passes
        breakdown["context_exchange"] = m * sum(prices.cp_comm_s[i] for i in critical_stages)
    host_bytes = host_capacity = 0.0
    if s.offload == "optimizer":  # the step on the CPU, and the PCIe copies it waits for
        breakdown.update(optimizer=0.0, offload_transfer=tails[critical].offload_transfer_s,
                         cpu_optimizer=tails[critical].optimizer_s)
        host_bytes = node_host_bytes([tail.offload.host_bytes for tail in tails], pricing.cluster)
        host_capacity = host_capacity_bytes(pricing.cluster)
    return Evaluation(
        strategy=s, global_batch=global_batch, seq_len=facts.seq_len, step_time_s=step_time,
        activation_scale=activation_scale(facts.precision, s.zero, s.offload, s.optimizer_state, compiled_layers(s),
                                          autocast_activations(pricing)),
        autocast_activations=autocast_activations(pricing), block_casts_once=pricing.block_casts_once,
        tokens_per_s=tokens / step_time, tflops_per_gpu=tflops_per_gpu,
        mfu=tflops_per_gpu * 1e12 / gpu.peak_flops_per_s(facts.precision),
        fits=all(m.total_bytes <= capacity for m in memory) and host_bytes <= host_capacity,
        memory=memory, breakdown=breakdown, stages=prices.stages, pipeline=pipe,
        capacity_bytes=capacity, headroom_bytes=headroom, rank_compute_s=rank_compute,
        host_memory_bytes=host_bytes, host_capacity_bytes=host_capacity,
    )


def with_fewest_recomputed_layers(evaluation: Evaluation, stages: list[list[Unit]],
                                  rerun: Callable[[Strategy], Evaluation], cache: CostCache | None = None) -> Evaluation:
    """`evaluation` (every layer recomputing) redone with each stage recomputing only the layers
    its rank needs to fit, when that is faster. `rerun(strategy)` evaluates a strategy on the
    same stages. The counts come from the memory model (`fewest_recomputed_layers`); a rank the
    re-evaluation still finds over capacity gets one more layer per chunk, a few times. `cache`:
    the caller's, for the units' activation bytes."""
    s = evaluation.strategy
    if s.recompute == "none" or s.recompute_layers is not None or not evaluation.fits:
        return evaluation
    # priced as `evaluate` priced them: the units of the attention and dropout the plan runs
    priced = [list(units) for units in evaluation.priced_units] or stages
    # per unit, computed once: the count search below sums them over every prefix of every rank
    autocast, once = evaluation.autocast_activations, evaluation.block_casts_once
    # (kept without recompute, kept under the policy, held while recomputing the unit)
    saved = {id(u): (unit_kept_bytes(u, s, "none", cache, autocast, once)[0],
                     *unit_kept_bytes(u, s, s.recompute, cache, autocast, once))
             for units in priced for u in units}

    def keeps(unit: Unit) -> float:
        kept, recomputed, _ = saved[id(unit)]
        return kept - recomputed

    def transient(unit: Unit) -> float:
        return saved[id(unit)][2]

    in_order = [u for units in priced for u in units]
    next_units = dict(zip((u.name for u in in_order), (*in_order[1:], None)))
    backward: dict[tuple[int, int], float] = {}

    def backward_bytes(stage: int, count: int) -> float:
        if (stage, count) not in backward:
            units = priced[stage]
            backward[stage, count] = stage_backward_bytes(
                s, units, first_layers_policies(units, s.recompute, count), next_units.get, evaluation.loss_unit,
                autocast, once, cache)
        return backward[stage, count]

    counts = fewest_recomputed_layers(
        strategy=s, stages=priced, total_bytes=[m.total_bytes for m in evaluation.memory],
        activation_bytes=[m.activations for m in evaluation.memory],
        stage_activation_bytes=[c.activation_bytes for c in evaluation.stages],
        margin_ratio=evaluation.activation_scale, capacity_bytes=evaluation.capacity_bytes,
        keeps_bytes=keeps, transient_bytes=transient, head_bytes=evaluation.rank_head_bytes,
        backward_bytes=backward_bytes, buffer_scale=1 + fragmentation(s.zero, s.offload, s.optimizer_state))
    layers = [sum(1 for u in units if u.layer_type is not None) for units in stages]
    for _ in range(4):
        if counts is None or list(counts) == layers or not any(counts):
            return evaluation  # none at all is the strategy without recompute, evaluated on its own
        trial = rerun(s.model_copy(update={"recompute_layers": counts}))
        if trial.fits:
            return trial if trial.step_time_s <= evaluation.step_time_s else evaluation
        full_ranks = {r for r, m in enumerate(trial.memory) if m.total_bytes > trial.capacity_bytes}
        counts = one_more_layer(counts, layers, s.pp, full_ranks, s.schedule)
    return evaluation


def partition(facts: ModelFacts, stages: int) -> list[list[Unit]]:
    """Layers split evenly over stages (extra layers to the middle stages); the units before the
    first layer join stage 0, those after a layer join that layer's stage, and those after the last
    layer the last stage when it holds no layer (the head alone, `even_stage_layers`)."""
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
        elif layer_positions and i > layer_positions[-1] and not sizes[-1]:
            current = stages - 1
        result[current].append(unit)
    if any(not stage for stage in result):
        raise ValueError(f"{stages} stages for {len(layer_positions)} layers leave a stage empty")
    return result
