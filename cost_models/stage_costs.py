"""What each pipeline stage costs per micro-batch: its units' compute, tp communication, recompute
and saved activations, summed under the strategy's recompute policy per layer.

The first named step of `evaluate`: pure functions of (facts, cluster, strategy), with a
`CostCache` the caller owns so that a search pricing thousands of strategies on one model derives
each unit's costs once per distinct argument set.
"""

from __future__ import annotations

import dataclasses
import functools

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.cluster import ClusterSpec
from autopar.plan_schema import Strategy, stage_rank
from autopar.cost_models.collectives import (GRADIENT_REDUCE_BYTES, keeps_shards, recomputed_reductions, regathered_inputs,
                                             vocab_parallel_head_collectives)
from autopar.cost_models.communication import GroupLayout, collective_time_s
from autopar.capabilities import gemm_padding_problem
from autopar.cost_models.compute import Efficiency, UnitTime, op_time_s, unit_time
from autopar.cost_models.context import rank_batch, replicas, unit_exchange_s
from autopar.cost_models.experts import all_to_all_time_s, replica_layout, unit_all_to_alls, unit_expert_params
from autopar.cost_models.facts import ModelFacts, OpFacts, Unit
from autopar.cost_models.memory import gradients_sharded, runs_autocast, state_bytes_per_param
from autopar.cost_models.recompute import stage_policies
from autopar.cost_models.compiled_stage import compiled_layers, logit_element_bytes, whole_stage_compiled
from autopar.cost_models.weight_passes import weight_pass_bytes


class CostCache:
    """Per-unit derived costs, keyed by the unit and the arguments they depend on. Owned by the
    caller (one per model being priced): nothing is stored on the facts. Each entry holds its
    unit, so a key's `id` is never reused by another unit while the entry lives. Units equal but
    for their names (a model's repeated layers) share their entries: every cost cached here is a
    function of what `_costed_content` compares, so a twin's is the same number."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[Unit, Any]] = {}
        self._tokens: dict[tuple, tuple[str, int]] = {}
        self._twin_of: dict[int, tuple[Unit, Unit]] = {}  # id(unit) -> (unit, the first unit equal to it)
        self._by_content: dict[tuple, Unit] = {}
        self._of_units: dict[tuple, tuple[tuple[Unit, ...], Any]] = {}

    def twin(self, unit: Unit) -> Unit:
        """The first unit this cache saw whose costed content is `unit`'s (`unit` itself if none)."""
        found = self._twin_of.get(id(unit))
        if found is not None and found[0] is unit:
            return found[1]
        twin = self._by_content.setdefault(_costed_content(unit), unit)
        self._twin_of[id(unit)] = (unit, twin)
        return twin

    def get(self, unit: Unit, key: tuple, compute: Callable[[], Any]) -> Any:
        unit = self.twin(unit)
        full_key = (id(unit), *key)
        hit = self._entries.get(full_key)
        if hit is not None and hit[0] is unit:
            return hit[1]
        value = compute()
        self._entries[full_key] = (unit, value)
        return value

    def token(self, key: tuple) -> tuple[str, int]:
        """A cheap stand-in for a key whose parts (pydantic links, dataclasses) hash slowly."""
        return self._tokens.setdefault(key, ("token", len(self._tokens)))

    def of_units(self, key: tuple, units: Sequence[Unit], compute: Callable[[], Any]) -> Any:
        """A cost of exactly these unit objects (a stage's), in order. The entry keeps them alive,
        so while it lives no other unit can take one of their ids: equal ids are the same units."""
        full_key = (key, *map(id, units))
        hit = self._of_units.get(full_key)
        if hit is None:
            hit = self._of_units[full_key] = (tuple(units), compute())
        return hit[1]


_UNIT_FIELDS = tuple(f.name for f in dataclasses.fields(Unit) if f.name != "name")
_OP_FIELDS = tuple(f.name for f in dataclasses.fields(OpFacts) if f.name != "name")


def _costed_content(unit: Unit) -> tuple:
    """Everything of a unit but its name and its ops' names: what its costs are computed from."""
    ops = tuple(tuple(getattr(op, field) for field in _OP_FIELDS) for op in unit.ops)
    return tuple(getattr(unit, field) for field in _UNIT_FIELDS if field != "ops") + (ops,)


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
    # the weight-gradient GEMMs' part of backward_s (`compute.UnitTime.backward_weight_s`): the W pass
    # a zero-bubble schedule defers (`cost_models.zero_bubble`)
    backward_weight_s: float = 0.0


@dataclass(frozen=True)
class UnitPart:
    """What one unit adds to its stage per micro-batch under one recompute policy."""

    forward_s: float
    backward_s: float
    forward_comm_s: float
    backward_comm_s: float
    recompute_s: float  # the repeated forward (and its collectives) before the backward
    transient_bytes: float  # the activations recompute rebuilds while this unit is differentiated
    activation_bytes: float  # kept from forward to backward
    params_on_device: float


@dataclass(frozen=True)
class StagePrices:
    """Every stage's cost, and what each pipeline rank holds."""

    stages: tuple[StageCost, ...]
    compute_s: tuple[float, ...]  # per stage and micro-batch: forward + backward, no communication
    recompute_s: tuple[float, ...]
    tp_comm_s: tuple[float, ...]  # tp and ZeRO-3 communication inside the passes
    rank_params: tuple[float, ...]  # per pipeline rank: parameters held (tp-local, tied copies included)
    rank_largest_unit_params: tuple[float, ...]
    # ep > 1, per stage and micro-batch: the MoE all-to-alls (forward, backward, recompute), exposed
    ep_comm_s: tuple[float, ...] = ()
    rank_expert_params: tuple[float, ...] = ()  # per pipeline rank: its share of expert parameters (over ep)
    # cp > 1, per stage and micro-batch: the attention exchange (ring p2p or ulysses all-to-all), exposed
    cp_comm_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class Pricing:
    """The arguments every step of one evaluation shares."""

    facts: ModelFacts
    cluster: ClusterSpec
    strategy: Strategy
    efficiency: Efficiency
    cache: CostCache
    tp_layout: GroupLayout
    dp_layout: GroupLayout
    vocab: int | None = None
    recompute_repeats: dict[str, tuple[tuple[str, float], ...]] | None = None
    # tp collectives once per step after backward (a dry run's record, DTensor realization)
    tp_step: tuple[tuple[str, float], ...] = ()
    selective_repeats: bool = False  # selective recompute resends `recompute_repeats` (a dry run saw it)
    autocast: bool | None = None  # None: where the runtime runs autocast (`autocast_runs`); set by floors
    # tp > 1 realized by the module rules, which cast a block's input once for all its projections
    # (`runtime/tensor_parallel/autocast.py`); False: each projection casts its own (DTensor's, unknown)
    block_casts_once: bool = False

    @functools.cached_property
    def next_units(self) -> dict[str, Unit | None]:
        """Each unit's successor in the model (None after the last): whose input its backward's gradient is."""
        units = self.facts.units
        return dict(zip((u.name for u in units), (*units[1:], None)))

    def autocast_runs(self) -> bool:
        """`runs_autocast` for this plan, unless a floor fixes it."""
        return self.autocast if self.autocast is not None else runs_autocast(self.strategy, self.facts.precision)

    def timed(self, unit: Unit) -> UnitTime:
        """One rank's passes: under cp, of its share of the micro-batch's positions (`context.rank_batch`)."""
        s, gpu, dtype = self.strategy, self.cluster.gpu, self.facts.precision
        compiled = whole_stage_compiled(s) or (s.compile and unit.layer_type is not None)
        padded = unit.padded_gemms and gemm_padding_problem(s, dtype) is None
        efficiency = dataclasses.replace(self.efficiency, compiled=compiled, padded_gemms=padded,
                                         autocast=self.autocast_runs())
        key = self.cache.token(("time", gpu.name, dtype, s.microbatch, s.cp, s.tp, s.sp, efficiency))
        return self.cache.get(unit, (key,), lambda: unit_time(unit, gpu, dtype, batch=rank_batch(s), tp=s.tp,
                                                              sp=s.sp, efficiency=efficiency, share=1 / s.cp))

    def attention_s(self, unit: Unit) -> tuple[float, float]:
        """(forward, backward) of the unit's attention kernels on one rank: what a ring's transfers hide behind."""
        s, gpu, dtype = self.strategy, self.cluster.gpu, self.facts.precision
        key = self.cache.token(("attention", gpu.name, dtype, s.microbatch, s.cp, s.tp, self.efficiency))

        def times() -> tuple[float, float]:
            return tuple(sum(op_time_s(op, gpu, dtype, batch=rank_batch(s), tp=s.tp, sp=s.sp,
                                       efficiency=self.efficiency) for op in ops if op.kind == "attention")
                         for ops in (unit.forward_ops, unit.backward_ops))
        return self.cache.get(unit, (key,), times)

    def tp_time_s(self, kind: str, size: float) -> float:
        return collective_time_s(kind, size, self.tp_layout, self.cluster)


def unit_activation_bytes(unit: Unit, batch: int, tp: int, sp: bool, recompute: str,
                          cache: CostCache | None = None, autocast: bool = False, gathered: bool = True,
                          casts_once: bool = False) -> float:
    """Bytes a unit keeps from forward to backward for one micro-batch on one tp rank; `autocast`: at
    autocast's dtypes where the facts count them (`autocast_activations`); `gathered`: under sequence
    parallelism column-parallel projections keep their gathered inputs (the runtime's; `Strategy.sp_inputs`);
    `casts_once`: at tp > 1 the runtime casts a block's input once for all its projections, as the
    module rules do (`Pricing.block_casts_once`; always under sequence parallelism, which only they run)."""
    args = (unit, batch, tp, sp, recompute, autocast, gathered, casts_once)
    if cache is None:
        return _activation_bytes(*args)
    return cache.get(unit, ("activations", *args[1:]), lambda: _activation_bytes(*args))


def unit_kept_bytes(unit: Unit, strategy, policy: str, cache: CostCache | None = None,
                    autocast: bool = False, casts_once: bool = False) -> tuple[float, float]:
    """(kept from forward to backward, held while it is recomputed) by one unit for one micro-batch on
    one rank under `policy`: recomputing rebuilds what the policy did not keep. `casts_once`: as for
    `unit_activation_bytes`."""
    s = strategy
    b = rank_batch(s)
    shards = keeps_shards(unit, s, policy)  # `regathered`: else what the checkpoint or the head keeps
    gathered = s.sp_inputs == "gathered" or (s.sp_inputs == "regathered" and not shards)

    def counted(recompute: str) -> float:
        return unit_activation_bytes(unit, b, s.tp, s.sp, recompute, cache, autocast, gathered, casts_once)

    kept = counted(policy)
    if policy == "none":  # kept shards: one block's input gathered again at a time in backward
        return kept, unit_gathered_bytes(unit, b, autocast, largest=True) if shards else 0.0
    full = counted("none")
    if policy == "selective":
        rebuilt = full - counted("selective_saved")
        if gathered and s.sp and s.tp > 1 and b > 1:
            # recomputing cuts the saved gather into sequences again (a chunk and a cat the policy does
            # not save): a second whole copy while the unit is differentiated
            rebuilt += unit_gathered_bytes(unit, b, autocast)
        return kept, rebuilt
    return kept, full


def _gathered_part(op: OpFacts, saved: float, counted: bool) -> tuple[float, float]:
    """(of `saved`, per sample, what column-parallel projections gathered; what they keep whole): each
    module reading it gathers its own copy (`OpFacts.gathered_blocks`). Under autocast `saved` holds one
    16-bit copy per module already (`_activation_bytes`); the trace holds the tensor once."""
    blocks = max(op.gathered_blocks, 1)
    if counted and op.autocast_gathered_bytes is not None:
        part = min(saved, blocks * op.autocast_gathered_bytes)
        return part, part
    part = min(saved, op.gathered_bytes)
    return part, part * blocks


def unit_gathered_bytes(unit: Unit, batch: int, autocast: bool = False, largest: bool = False) -> float:
    """A unit's gathered inputs whole, for one micro-batch on one rank (sequence parallelism); `largest`:
    the largest one alone (one module's copy)."""
    counted = autocast and unit.autocast_input_bytes is not None
    parts = [0.0]
    for op in unit.forward_ops:
        saved = op.autocast_saved_bytes if counted and op.autocast_saved_bytes is not None else op.saved_bytes
        whole = _gathered_part(op, saved, counted)[1] * batch
        parts.append(whole / max(op.gathered_blocks, 1) if largest else whole)
    return max(parts) if largest else sum(parts)


def _activation_bytes(unit: Unit, batch: int, tp: int, sp: bool, recompute: str, autocast: bool = False,
                      gathered: bool = True, casts_once: bool = False) -> float:
    """Full recompute keeps the unit's input. Selective keeps it, what the products save, and every
    output of the projections and fused attention (`OpFacts.output_bytes`), as the runtime's policy
    caches them (`runtime.recompute`), read by backward or not; it recomputes the vector ops,
    autocast's casts among them. `selective_saved`: of what
    selective keeps, what backward reads (the rest of a layer's saved bytes is what recomputing it
    rebuilds). None: every op's saved bytes. Under sequence parallelism every op's bytes are a sequence
    shard but the inputs column-parallel projections gather, which they keep whole."""
    if recompute not in ("none", "selective", "selective_saved", "full"):
        raise ValueError(f"unknown recompute policy {recompute!r}")
    counted = autocast and unit.autocast_input_bytes is not None
    kept_input = (unit.autocast_input_bytes if counted else unit.input_bytes) * batch / (tp if sp else 1)
    if recompute == "full":
        return kept_input
    gathers = gathered and sp and tp > 1  # column-parallel projections keep their gathered inputs whole (`OpFacts.gathered_bytes`)
    total = 0.0
    for op in unit.forward_ops:
        saved = op.autocast_saved_bytes if counted and op.autocast_saved_bytes is not None else op.saved_bytes
        blocks = max(op.gathered_blocks, 1)
        if counted and (sp or casts_once) and tp > 1 and op.gathered_readers > blocks and op.autocast_gathered_bytes:
            # each module casts its input once for all of its projections
            saved -= (op.gathered_readers - blocks) * op.autocast_gathered_bytes
        part, whole = _gathered_part(op, saved, counted) if gathers else (0.0, 0.0)
        if recompute != "none" and op.kind == "vector":
            total += whole * batch  # the gather's output: selective recompute saves it
            continue
        if recompute == "selective":
            saved = max(saved, op.output_bytes)
        if saved:
            total += (saved - part) * batch / (tp if (op.saved_sharded or sp) else 1) + whole * batch
    if recompute != "none":
        total += kept_input
    return total


def autocast_activations(pricing: Pricing) -> bool:
    """Whether activations are counted at autocast's dtypes (`counts_autocast_activations`)."""
    return counts_autocast_activations(pricing.facts, pricing.strategy, pricing.autocast_runs())


def counts_autocast_activations(facts: ModelFacts, strategy, autocast_runs: bool | None = None) -> bool:
    """Whether activations are counted at autocast's dtypes: where the runtime runs autocast
    (`runs_autocast`, unless `autocast_runs` says) and the facts count them
    (`ModelFacts.autocast_activation_factor`), but not for a stage compiled whole without recompute,
    whose min-cut ratio is to the traced bytes (`compiled_stage`)."""
    runs = runs_autocast(strategy, facts.precision) if autocast_runs is None else autocast_runs
    return runs and facts.autocast_activation_factor is not None and not compiled_layers(strategy)


def unit_part(pricing: Pricing, unit: Unit, policy: str, token: tuple[str, int] | None = None) -> UnitPart:
    """A unit's times and bytes under `policy`; cached unless per-plan `recompute_repeats` apply.
    `token`: `part_token(pricing, policy)`, when the caller has it."""
    if pricing.recompute_repeats is not None:
        return _unit_part(pricing, unit, policy)
    key = token or part_token(pricing, policy)
    return pricing.cache.get(unit, (key,), lambda: _unit_part(pricing, unit, policy))


def part_token(pricing: Pricing, policy: str) -> tuple[str, int]:
    """The cache token of `unit_part`'s arguments other than the unit (one per evaluation and policy)."""
    s, cluster = pricing.strategy, pricing.cluster
    # compile: whether the code outside the layers compiles too (`Pricing.timed`)
    compiled = whole_stage_compiled(s)
    # padding: whether the runtime pads the misaligned linear layers (`Pricing.timed`; pp is not in the key)
    padded = gemm_padding_problem(s, pricing.facts.precision) is None
    return pricing.cache.token(("part", cluster.gpu.name, pricing.facts.precision, s.microbatch, s.cp, s.tp, s.sp,
                                policy, s.tp_overlap, pricing.efficiency, cluster.gpus_per_node, cluster.intra_node,
                                cluster.inter_node, s.compile, compiled, padded, pricing.autocast_runs(),
                                autocast_activations(pricing), s.sp_inputs, pricing.block_casts_once))  # it also depends on s.recompute and the facts


def _tp_reduce_time_s(pricing: Pricing, total_bytes: float, count: int,
                      others: tuple[tuple[str, float], ...] = (), matmul_s: float = 0.0) -> float:
    """The tp collectives of a unit's pass, exposed: all of them, or with `tp_overlap` what the
    pass's GEMMs cannot hide. Overlap splits each collective into tp chunks pipelined with the
    GEMM's own (Transformer Engine's userbuffers; Wang et al., "Overlap Communication with
    Dependent Computation via Decomposition", ASPLOS'23), so one chunk's transfer stays exposed."""
    s = pricing.strategy
    if s.tp == 1:
        return 0.0
    reduces = count * pricing.tp_time_s("all_reduce", total_bytes / count) if count else 0.0
    comm = reduces + sum(pricing.tp_time_s(kind, size) for kind, size in others)
    if not s.tp_overlap or comm == 0:
        return comm
    return max(comm - matmul_s, comm / s.tp)


def _unit_part(pricing: Pricing, unit: Unit, policy: str) -> UnitPart:
    s, cache = pricing.strategy, pricing.cache
    b = rank_batch(s)  # one rank's positions: b/cp sequences' worth
    t = pricing.timed(unit)
    kept, transient = unit_kept_bytes(unit, s, policy, cache, autocast_activations(pricing), pricing.block_casts_once)
    recompute_s = 0.0
    if policy == "full":
        if s.tp == 1:
            repeated = []
        elif pricing.recompute_repeats is None:
            repeated = recomputed_reductions(unit, b, s.sp, 1 / s.cp)
        else:
            repeated = [(kind, size * b, 1) for kind, size in pricing.recompute_repeats.get(unit.name, ())]
        recompute_s = t.forward_s + sum(times * pricing.tp_time_s(kind, size) for kind, size, times in repeated)
    elif policy == "selective":
        recompute_s = t.forward_vector_s
        if pricing.selective_repeats and pricing.recompute_repeats and s.tp > 1:
            recompute_s += sum(pricing.tp_time_s(kind, size * b) for kind, size in
                               pricing.recompute_repeats.get(unit.name, ()))
    return UnitPart(
        forward_s=t.forward_s, backward_s=t.backward_s,
        forward_comm_s=_tp_reduce_time_s(pricing, t.forward_reduce_bytes, t.forward_reduces, t.forward_collectives,
                                         t.forward_matmul_s),
        backward_comm_s=_tp_reduce_time_s(pricing, t.backward_reduce_bytes, t.backward_reduces,
                                          (*t.backward_collectives, *(("all_gather", size) for size in
                                                                      regathered_inputs(unit, b, s, policy))),
                                          t.backward_matmul_s),
        recompute_s=recompute_s, transient_bytes=transient, activation_bytes=kept,
        params_on_device=unit.params_on_device(s.tp))


def _zero3_exposed_s(pricing: Pricing, units: Sequence[Unit], policies: Sequence[str], forward_s: float,
                     backward_s: float) -> tuple[float, float]:
    """ZeRO-3's per-micro-batch weight gathers (and gradient scatters, but under pipeline stages, which
    reduce once per step) left after overlapping them with the stage's compute: at least the first layer's gather is exposed; all of them without
    `dp_overlap` (no prefetch), and with `zero3_fetch=parameter` (`parameter_fetch_s`)."""
    s = pricing.strategy
    if s.zero < 3 or replicas(s) == 1:
        return 0.0, 0.0
    per = state_bytes_per_param(pricing.facts.precision, s.optimizer_state)
    if s.zero3_fetch == "parameter":
        forward, backward = parameter_fetch_s(pricing, units, policies, per.weight)
        scatter = collective_time_s("reduce_scatter", sum(u.params_on_device(s.tp) for u in units)
                                    * GRADIENT_REDUCE_BYTES, pricing.dp_layout, pricing.cluster) \
            if gradients_sharded(s.zero, s.pp) else 0.0
        return forward, backward + (scatter if not s.dp_overlap else max(scatter - backward_s, 0.0))
    experts = sum(unit_expert_params(pricing.facts.experts, u.name) for u in units) if s.ep > 1 else 0.0
    stage_params = sum(u.params_on_device(s.tp) for u in units) - experts
    gather = collective_time_s("all_gather", stage_params * per.weight, pricing.dp_layout, pricing.cluster)
    scatter = collective_time_s("reduce_scatter", stage_params * GRADIENT_REDUCE_BYTES, pricing.dp_layout,
                                pricing.cluster)
    if experts and s.dp > s.ep:  # ep: the expert slices over their replicas (`cost_models.experts`)
        expert_replicas = replica_layout(s, pricing.cluster.gpus_per_node)
        gather += collective_time_s("all_gather", experts / s.ep * per.weight, expert_replicas, pricing.cluster)
        scatter += collective_time_s("reduce_scatter", experts / s.ep * GRADIENT_REDUCE_BYTES, expert_replicas,
                                     pricing.cluster)
    if not gradients_sharded(s.zero, s.pp):  # under pp reduced once per step (`evaluate.rank_tails`)
        scatter = 0.0
    if not s.dp_overlap:
        return gather, gather + scatter
    first = gather / max(len(units), 1)
    return max(gather - forward_s, first), max(gather + scatter - backward_s, first)


def parameter_fetch_s(pricing: Pricing, units: Sequence[Unit], policies: Sequence[str], weight_bytes: int
                      ) -> tuple[float, float]:
    """`zero3_fetch=parameter`: one all-gather per parameter tensor and use, none overlapped
    (`cost_models.implementation`): (forward, backward), a fully recomputed unit fetching again for
    its recompute."""
    s, forward, backward = pricing.strategy, 0.0, 0.0
    for unit, policy in zip(units, policies):
        fetch = sum(collective_time_s("all_gather", math.prod(shape) / (s.tp if tp_dim is not None else 1)
                                      * weight_bytes, pricing.dp_layout, pricing.cluster)
                    for shape, tp_dim in unit.param_shapes)
        forward += fetch
        backward += fetch * (2 if policy == "full" else 1)
    return forward, backward


def largest_fetch(unit: Unit, strategy: Strategy) -> float:
    """Parameters ZeRO-3 holds gathered at a time from `unit`: the unit (FSDP2), or with
    `zero3_fetch=parameter` its largest tensor (a module's own, in practice one weight)."""
    if strategy.zero3_fetch == "parameter":
        return max((math.prod(shape) / (strategy.tp if tp_dim is not None else 1) for shape, tp_dim in
                    unit.param_shapes), default=0.0)
    return unit.params_on_device(strategy.tp)


def price_stages(pricing: Pricing, stages_units: Sequence[Sequence[Unit]]) -> StagePrices:
    """Each (virtual) stage's forward and backward pass for one micro-batch, and each rank's holdings."""
    s = pricing.strategy
    stage_costs: list[StageCost] = []
    compute, recompute, tp_comm, ep_comm, cp_comm = [], [], [], [], []
    rank_params = [0.0] * s.pp
    rank_largest = [0.0] * s.pp
    rank_experts = [0.0] * s.pp
    tokens: dict[str, tuple[str, int]] = {}
    shared = None  # stage sums are cached per stage's units when unit parts are (no per-plan recompute repeats)
    if pricing.recompute_repeats is None:
        shared = pricing.cache.token(("stage", part_token(pricing, s.recompute), part_token(pricing, "none"),
                                      s.recompute, s.ep, s.zero3_fetch, pricing.facts.experts if s.ep > 1 else ()))
    for index, units in enumerate(stages_units):
        rank = stage_rank(index, s.pp, s.schedule)
        if shared is None:
            sums = _stage_sums(pricing, units, index, tokens)
        else:
            limit = None if s.recompute_layers is None else s.recompute_layers[index]
            sums = pricing.cache.of_units((shared, limit), units, lambda: _stage_sums(pricing, units, index, tokens))
        policies, forward, backward, forward_comm = sums.policies, sums.forward_s, sums.backward_s, sums.forward_comm_s
        ep_forward, ep_backward = _expert_all_to_alls_s(pricing, units, policies)
        cp_forward, cp_backward = _context_exchange_s(pricing, units, policies)
        for held in sums.held:
            rank_params[rank] += held
        if s.ep > 1:
            for experts in sums.expert_shares:
                rank_experts[rank] += experts
        rank_largest[rank] = max(rank_largest[rank], sums.largest)
        if pricing.vocab and s.tp > 1 and index == len(stages_units) - 1:
            forward_comm += sum(times * pricing.tp_time_s(kind, size) for kind, size, times in
                                vocab_parallel_head_collectives(s, pricing.facts.precision, pricing.facts.seq_len,
                                                                pricing.vocab))
        passes_forward, passes_backward = _weight_passes_s(pricing, sums)
        forward, backward = forward + passes_forward, backward + passes_backward
        zero3_forward, zero3_backward = _zero3_exposed_s(pricing, units, policies, forward, backward)
        stage_costs.append(StageCost(
            index, rank, sums.names, forward + forward_comm + zero3_forward + ep_forward + cp_forward,
            backward + sums.backward_comm_s + sums.recompute_s + zero3_backward + ep_backward + cp_backward,
            sums.activation_bytes + retained_output_bytes(pricing, index, len(stages_units)), sums.transient_bytes,
            sums.recomputed_layers, sums.backward_weight_s))
        compute.append(forward + backward)
        recompute.append(sums.recompute_s)
        tp_comm.append(forward_comm + sums.backward_comm_s + zero3_forward + zero3_backward)
        ep_comm.append(ep_forward + ep_backward)
        cp_comm.append(cp_forward + cp_backward)
    return StagePrices(tuple(stage_costs), tuple(compute), tuple(recompute), tuple(tp_comm), tuple(rank_params),
                       tuple(rank_largest), tuple(ep_comm), tuple(rank_experts), tuple(cp_comm))


@dataclass(frozen=True)
class _StageSums:
    """What a stage's units add up to under the strategy's recompute counts, before the terms that
    depend on more of the strategy (ZeRO-3, ep, cp, the vocabulary-parallel head)."""

    names: tuple[str, ...]
    policies: tuple[str, ...]
    forward_s: float
    backward_s: float
    forward_comm_s: float
    backward_comm_s: float
    recompute_s: float
    held: tuple[float, ...]  # per unit: parameters on the rank (experts sharded over ep), added in order
    expert_shares: tuple[float, ...]  # per unit: its expert parameters over ep
    largest: float  # the most parameters ZeRO-3 gathers at once
    activation_bytes: float
    transient_bytes: float
    recomputed_layers: int
    backward_weight_s: float


def _stage_sums(pricing: Pricing, units: Sequence[Unit], index: int, tokens: dict[str, tuple[str, int]]
                ) -> _StageSums:
    s = pricing.strategy
    policies = stage_policies(units, s, index)
    for policy in set(policies).difference(tokens):
        tokens[policy] = part_token(pricing, policy)
    parts = [unit_part(pricing, unit, policy, tokens[policy]) for unit, policy in zip(units, policies)]
    held, shares, largest = [], [], 0.0
    for unit, part in zip(units, parts):
        # 3-D expert weights: the graph's tp sharding leaves them whole on each tp rank
        experts = unit_expert_params(pricing.facts.experts, unit.name) if s.ep > 1 else 0.0
        held.append(part.params_on_device - experts * (1 - 1 / s.ep))  # experts sharded over ep
        shares.append(experts / s.ep)
        largest = max(largest, held[-1] if s.zero3_fetch == "unit" else largest_fetch(unit, s))
    return _StageSums(
        names=tuple(u.name for u in units), policies=tuple(policies),
        forward_s=sum(p.forward_s for p in parts), backward_s=sum(p.backward_s for p in parts),
        forward_comm_s=sum(p.forward_comm_s for p in parts), backward_comm_s=sum(p.backward_comm_s for p in parts),
        recompute_s=sum(p.recompute_s for p in parts), held=tuple(held), expert_shares=tuple(shares), largest=largest,
        activation_bytes=sum(p.activation_bytes for p in parts),
        transient_bytes=max((p.transient_bytes for p in parts), default=0.0),
        recomputed_layers=sum(policy != "none" for policy in policies),
        backward_weight_s=sum(pricing.timed(unit).backward_weight_s for unit in units))


def _weight_passes_s(pricing: Pricing, sums: _StageSums) -> tuple[float, float]:
    """One micro-batch's passes over the stage's weights outside its GEMMs (`cost_models.weight_passes`):
    (forward, backward), on the HBM roofline."""
    recomputed = sum(held for held, policy in zip(sums.held, sums.policies) if policy != "none")
    moved = weight_pass_bytes(sum(sums.held), recomputed, pricing.strategy, pricing.facts.precision)
    bandwidth = pricing.cluster.gpu.hbm_bandwidth_bytes_per_s * pricing.efficiency.memory
    return moved[0] / bandwidth, moved[1] / bandwidth


def _context_exchange_s(pricing: Pricing, units: Sequence[Unit], policies: Sequence[str]) -> tuple[float, float]:
    """One micro-batch's exposed attention exchange on a stage under cp > 1 (`cost_models.context`):
    (forward, backward with full recompute's repeat)."""
    s = pricing.strategy
    forward = backward = 0.0
    if s.cp == 1:
        return forward, backward
    for unit, policy in zip(units, policies):
        f, b = unit_exchange_s(pricing.facts.attention, unit.name, s, policy, pricing.cluster,
                               *pricing.attention_s(unit))
        forward += f
        backward += b
    return forward, backward


def _expert_all_to_alls_s(pricing: Pricing, units: Sequence[Unit], policies: Sequence[str]) -> tuple[float, float]:
    """One micro-batch's MoE all-to-alls on a stage under ep > 1: (forward, backward with recompute's)."""
    s = pricing.strategy
    forward = backward = 0.0
    if s.ep == 1:
        return forward, backward
    for unit, policy in zip(units, policies):
        for phase, size, calls in unit_all_to_alls(pricing.facts.experts, unit.name, s.microbatch, policy):
            seconds = calls * all_to_all_time_s(size, s, pricing.cluster)
            if phase == "forward":
                forward += seconds
            else:
                backward += seconds
    return forward, backward


def retained_output_bytes(pricing: Pricing, index: int, stages: int) -> float:
    """`last_stage_kept_bytes` on a pipeline's last stage, 0 elsewhere."""
    s = pricing.strategy
    if s.pp == 1 or index != stages - 1:
        return 0.0
    return last_stage_kept_bytes(pricing.facts, s, autocast_activations(pricing))


def last_stage_kept_bytes(facts: ModelFacts, s: Strategy, autocast: bool) -> float:
    """What a pipeline's last stage keeps per micro-batch beside the saved activations its units count.
    Torch's pipelining holds each stage's output until that micro-batch's backward (`fwd_cache`); the
    last stage's is the logits, whole over tp (gathered for the loss), in the compute precision. The
    loss, run on those whole logits, saves its log-probabilities whole, where the facts count the last
    unit's vocabulary-sharded tensors as tp shards (Megatron-LM's layout): (tp - 1)/tp of them more.
    Measured on CPU/gloo (`benchmarks/rank_memory_cases.py`): at its peak the last stage held one
    logits-sized tensor per micro-batch in flight that the graph's saved tensors do not count; under
    pp = 2 × tp = 2, the log-probabilities whole (0.925 of the model before they were counted). Other
    stages' outputs (one hidden state each) are left out."""
    if not facts.vocab:
        return 0.0
    logits = s.microbatch * facts.seq_len * facts.vocab * logit_element_bytes(facts.precision)
    if s.tp == 1 or not facts.units:
        return logits
    sharded = sum(op.autocast_saved_bytes if autocast and op.autocast_saved_bytes is not None else op.saved_bytes
                  for op in facts.units[-1].forward_ops if op.saved_sharded)
    return logits + rank_batch(s) * sharded * (1 - 1 / s.tp)