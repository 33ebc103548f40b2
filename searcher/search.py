"""The plan search: outer choices × inter-op partition × intra-op sharding, under one cost model.

1. Enumerate every completion of the fixed keys over (dp, tp, pp, zero, recompute, micro-batch,
   schedule, vp, sp) that the runtime can execute (`autopar.capabilities`) and that breaks no rule,
   and rank them with the closed-form pipeline estimate on an even layer split.
2. For the best few: solve each distinct unit's tensor-parallel sharding with the intra-op ILP
   (once per layer type: its instances are tied), cut the units into stages with the inter-op
   dynamic program, and evaluate exactly (simulated schedule).
3. Keep the fastest plan that fits, the runners-up, and why-not rows for the obvious alternatives.
No nn.Module is touched here: inputs are the op graph, its facts and the cluster.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from autopar.capabilities import RUNTIME_CAPABILITIES, Capabilities
from autopar.cluster import ClusterSpec
from autopar.errors import AutoparError
from autopar.graph.ir import OpGraph
from autopar.plan import Strategy
from cost_models.compute import DEFAULT_EFFICIENCY, Efficiency, unit_time
from cost_models.communication import collective_time_s, group_layout
from cost_models.evaluate import Evaluation, evaluate, partition as even_partition, unit_activation_bytes
from cost_models.facts import ModelFacts, Unit
from cost_models.memory import state_bytes_per_param, usable_bytes
from cost_models.strategy import check_strategy
from cost_models.whatif import quick_evaluations
from searcher.inter_op import UnitCost, partition as dp_partition

REFINE_TOP = 12


@dataclass
class Candidate:
    evaluation: Evaluation
    stages: list[list[Unit]]
    op_placements: dict[str, str] = field(default_factory=dict)
    param_placements: dict[str, str] = field(default_factory=dict)  # tp-axis placement per parameter

    @property
    def strategy(self) -> Strategy:
        return self.evaluation.strategy


@dataclass
class WhyNot:
    label: str
    strategy: Strategy | None
    reason: str


@dataclass
class SearchResult:
    best: Candidate | None
    ranked: list[Candidate]
    why_not: list[WhyNot]
    candidates: int
    rejected: dict[str, int]
    search_s: float
    ilp_variables: int = 0
    ilp_solve_s: float = 0.0
    ilp_refused: int = 0  # ILP solutions the runtime could not execute (the propagation's plan stood)


def search(
    graph: OpGraph,
    facts: ModelFacts,
    cluster: ClusterSpec,
    global_batch: int,
    *,
    fixed: dict[str, Any] | None = None,
    layers: int | None = None,
    top_k: int = 5,
    capabilities: Capabilities = RUNTIME_CAPABILITIES,
    efficiency: Efficiency = DEFAULT_EFFICIENCY,
    use_ilp: bool = True,
) -> SearchResult:
    started = time.perf_counter()
    fixed = dict(fixed or {})
    layers = layers if layers is not None else max(len(facts.layer_units), 1)
    quick, count, rejected = quick_evaluations(facts, cluster, fixed, global_batch, layers=layers,
                                               efficiency=efficiency, supports=capabilities.supports)
    quick.sort(key=_rank_key)

    refiner = _Refiner(graph, facts, cluster, global_batch, efficiency, use_ilp, fixed, capabilities)
    ranked = [refiner.refine(e.strategy) for e in quick[:REFINE_TOP]]
    ranked.sort(key=lambda c: _rank_key(c.evaluation))
    best = ranked[0] if ranked[0].evaluation.fits else None
    why_not = _why_not(ranked, quick, facts, cluster, global_batch, efficiency, best)
    return SearchResult(
        best=best, ranked=ranked[:top_k], why_not=why_not, candidates=count, rejected=rejected,
        search_s=time.perf_counter() - started, ilp_variables=refiner.ilp_variables,
        ilp_solve_s=refiner.ilp_solve_s, ilp_refused=refiner.ilp_refused,
    )


def _rank_key(evaluation: Evaluation) -> tuple:
    s = evaluation.strategy
    # Fitting plans first, then speed; ties broken by a fixed order of the knobs (determinism).
    return (not evaluation.fits, round(evaluation.step_time_s, 9), s.pp, s.tp, s.zero, s.microbatch,
            s.schedule, s.vp, s.recompute, s.sp)


class _Refiner:
    """Intra-op ILP per distinct unit (cached: layer instances share one solve) and the inter-op DP."""

    def __init__(self, graph, facts, cluster, global_batch, efficiency, use_ilp, fixed, capabilities) -> None:
        self.graph, self.facts, self.cluster = graph, facts, cluster
        self.capabilities = capabilities
        self.ilp_refused = 0
        self.fixed = fixed
        self.global_batch, self.efficiency = global_batch, efficiency
        self.use_ilp = use_ilp
        self.cache: dict[tuple, Any] = {}
        self.ilp_variables = 0
        self.ilp_solve_s = 0.0

    def units_for(self, strategy: Strategy) -> tuple[list[Unit], dict[str, str], dict[str, str]]:
        if strategy.tp == 1 or not self.use_ilp:
            return list(self.facts.units), {}, {}
        try:
            from searcher.intra_op import solve_unit
        except ImportError:  # the ILP is optional: the Megatron-style propagation stands in
            return list(self.facts.units), {}, {}
        units, op_placements, param_placements = [], {}, {}
        for unit in self.facts.units:
            key = (unit.layer_type or unit.name, strategy.tp, strategy.microbatch)
            if key not in self.cache:
                solution = solve_unit(unit, self.graph, tp=strategy.tp, batch=strategy.microbatch,
                                      cluster=self.cluster, dtype=self.facts.precision, efficiency=self.efficiency)
                self.cache[key] = solution
                self.ilp_variables += getattr(solution, "variables", 0)
                self.ilp_solve_s += getattr(solution, "solve_s", 0.0)
            solution = self.cache[key]
            solved = getattr(solution, "unit", unit)  # its sharded_params follow the chosen parameter placements
            units.append(dataclasses.replace(unit, ops=_renamed(solution.ops, unit),
                                             sharded_params=solved.sharded_params))
            op_placements.update(solution.op_placements)
            param_placements.update(solution.param_placements)
        return units, op_placements, param_placements

    def refine(self, strategy: Strategy) -> Candidate:
        """The better of Megatron-style tensor parallelism (graph propagation, with the strategy's
        sequence parallelism) and the intra-op ILP's sharding, each on its best stage partition."""
        candidates = [self._refine_with(strategy, list(self.facts.units), {}, {})]
        if strategy.sp and self.fixed.get("sp"):  # the user asked for Megatron sequence parallelism
            return candidates[0]
        units, op_placements, param_placements = self.units_for(strategy)
        check = self.capabilities.check_placements
        planned = {name: f"S({dim})" for name, dim in self.facts.param_tp_dims.items()}  # as plan_builder fills in
        planned.update(param_placements)
        if op_placements and check is not None and check(executed_tp_placements(planned)) is not None:
            self.ilp_refused += 1  # the runtime could not run these placements: keep the propagation's plan
            return candidates[0]
        if op_placements:
            # The ILP places every op itself (sequence sharding included), so the blanket
            # sequence-parallel discount of the propagation model must not apply on top.
            candidates.append(self._refine_with(strategy.model_copy(update={"sp": False}), units, op_placements,
                                                param_placements))
        return min(candidates, key=lambda c: _rank_key(c.evaluation))

    def _refine_with(self, strategy: Strategy, units, op_placements, param_placements) -> Candidate:
        facts = dataclasses.replace(self.facts, units=tuple(units))
        even_stages = even_partition(facts, strategy.pp * strategy.vp)
        even = evaluate(facts, self.cluster, strategy, self.global_batch, efficiency=self.efficiency,
                        stages=even_stages)
        searched = self._partition(facts, strategy)
        if searched is not None and searched != even_stages:
            evaluation = evaluate(facts, self.cluster, strategy, self.global_batch, efficiency=self.efficiency,
                                  stages=searched)
            if _rank_key(evaluation) < _rank_key(even):  # the DP balances an estimate: keep what simulates better
                return Candidate(evaluation, searched, op_placements, param_placements)
        return Candidate(even, even_stages, op_placements, param_placements)

    def _partition(self, facts: ModelFacts, strategy: Strategy) -> list[list[Unit]] | None:
        s = strategy
        stages = s.pp * s.vp
        if stages == 1:
            return None
        per = state_bytes_per_param(facts.precision)
        state = per.weight / (s.dp if s.zero >= 3 else 1) + per.gradient / (s.dp if s.zero >= 2 else 1) \
            + per.optimizer / (s.dp if s.zero >= 1 else 1)
        tp_layout = group_layout(s.tp, 1, self.cluster.gpus_per_node)
        costs = []
        for unit in facts.units:
            t = unit_time(unit, self.cluster.gpu, facts.precision, batch=s.microbatch, tp=s.tp, sp=s.sp,
                          efficiency=self.efficiency)
            comm = 0.0
            if s.tp > 1:
                for total, count in ((t.forward_reduce_bytes, t.forward_reduces),
                                     (t.backward_reduce_bytes, t.backward_reduces)):
                    if count:
                        comm += count * collective_time_s("all_reduce", total / count, tp_layout, self.cluster)
            recompute = t.forward_s if (s.recompute == "full" and unit.layer_type) else 0.0
            policy = s.recompute if unit.layer_type else "none"
            full = unit_activation_bytes(unit, s.microbatch, s.tp, s.sp, "none")
            params = unit.params_on_device(s.tp)
            costs.append(UnitCost(
                time_s=t.forward_s + t.backward_s + comm + recompute,
                state_bytes=params * state,
                activation_bytes=unit_activation_bytes(unit, s.microbatch, s.tp, s.sp, policy),
                transient_bytes=full if policy != "none" else 0.0,
            ))
        bounds = dp_partition(costs, stages, num_microbatches=s.num_microbatches,
                              schedule="gpipe" if s.schedule == "gpipe" else "1f1b",
                              memory_capacity_bytes=usable_bytes(self.cluster.gpu.memory_bytes) / 1.05)
        if bounds is None:
            return None
        return [list(facts.units[a:b]) for a, b in bounds]


def executed_tp_placements(param_placements: dict[str, str]) -> dict[str, str]:
    """Tp placements as the runtime executes them: a column-parallel Linear's bias splits with its
    weight (what `plan_builder` writes too)."""
    placements = dict(param_placements)
    for name, placement in param_placements.items():
        if name.endswith(".weight") and placement == "S(0)":
            placements[name.removesuffix(".weight") + ".bias"] = "S(0)"
    return placements


def _renamed(ops, unit: Unit):
    """A tied solve is stored with the first instance's op names; map them onto this instance."""
    if len(ops) != len(unit.ops):
        return tuple(ops)
    return tuple(dataclasses.replace(new, name=old.name) for new, old in zip(ops, unit.ops))


def _why_not(ranked, quick, facts, cluster, global_batch, efficiency, best) -> list[WhyNot]:
    reference = best.evaluation if best else ranked[0].evaluation
    rows: list[WhyNot] = []
    for candidate in ranked[1:4]:
        rows.append(WhyNot("runner-up", candidate.strategy, _reason(candidate.evaluation, reference)))
    world, per_node = cluster.world_size, cluster.gpus_per_node
    obvious = {
        "pure data parallel": lambda s: s.tp == 1 and s.pp == 1,
        f"tensor parallel only (tp={min(per_node, world)})": lambda s: s.tp == min(per_node, world) and s.pp == 1,
        "no pipeline (pp=1)": lambda s: s.pp == 1,
    }
    representative = {
        "pure data parallel": (world, 1),
        f"tensor parallel only (tp={min(per_node, world)})": (world // min(per_node, world), min(per_node, world)),
        "no pipeline (pp=1)": None,
    }
    for label, wanted in obvious.items():
        options = [e for e in quick if wanted(e.strategy)]
        if not options:
            rows.append(WhyNot(label, None, _rule_broken(representative[label], facts, cluster, global_batch)))
            continue
        choice = options[0]  # quick is ranked: the best of its family
        exact = evaluate(facts, cluster, choice.strategy, global_batch, efficiency=efficiency)
        if best is not None and choice.strategy == best.strategy:
            continue
        rows.append(WhyNot(label, choice.strategy, _reason(exact, reference)))
    return rows


def _reason(evaluation: Evaluation, reference: Evaluation) -> str:
    gib = 2**30
    if not evaluation.fits:
        return (f"needs {evaluation.peak_memory_bytes / gib:.1f} GiB > {evaluation.capacity_bytes / gib:.1f} GiB "
                f"usable per GPU")
    ratio = evaluation.step_time_s / reference.step_time_s
    growth = {k: evaluation.breakdown.get(k, 0.0) - reference.breakdown.get(k, 0.0) for k in evaluation.breakdown}
    key, extra = max(growth.items(), key=lambda item: item[1])
    detail = f"{key.replace('_', ' ')} +{extra:.2f} s" if extra > 0 else "slower overall"
    return f"{ratio:.2f}× step time ({detail})"


def _rule_broken(degrees, facts: ModelFacts, cluster: ClusterSpec, global_batch: int) -> str:
    """Why no strategy of a family is valid: the rule its plainest member breaks."""
    if degrees is not None:
        dp, tp = degrees
        try:
            plain = Strategy(dp=dp, tp=tp, pp=1, microbatch=1, num_microbatches=max(global_batch // dp, 1))
            check_strategy(plain, world_size=cluster.world_size, global_batch=global_batch,
                           layers=max(len(facts.layer_units), 1), heads=facts.heads, kv_heads=facts.kv_heads)
        except (AutoparError, ValueError) as error:
            return f"invalid: {error}"
    return "excluded by a rule or by what the runtime can execute"
