"""Refining a ranked strategy into a plan candidate: the intra-op ILP's tp placements per distinct
unit (one solve per layer type, tp, micro-batch and memory budget, given to every instance), each
layout dry-run or checked against what the runtime can run and priced as it runs (`placed_units`,
`dry_run_units`), then cut into stages by the inter-op dynamic program and evaluated exactly
(`cost_models.evaluate`). The search (`searcher.search`) chooses among the candidates."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from autopar.errors import AutoparError
from autopar.graph.ir import TensorMeta
from autopar.plan_schema import Strategy
from autopar.cost_models.compute import unit_time
from autopar.cost_models.communication import collective_time_s, group_layout
from autopar.cost_models.context import rank_batch
from autopar.cost_models.backward_memory import head_gradient_bytes, unit_working_bytes
from autopar.cost_models.evaluate import (Evaluation, evaluate, partition as even_partition,
                                          with_fewest_recomputed_layers)
from autopar.cost_models.placed_collectives import PlacedLayout, dry_run_units, placed_units
from autopar.cost_models.facts import ModelFacts, Unit, model_facts
from autopar.cost_models.collectives import head_vocab
from autopar.cost_models.stage_costs import (CostCache, last_stage_kept_bytes, runs_autocast, unit_activation_bytes,
                                             unit_kept_bytes)
from autopar.searcher.candidates import fit_recompute, unfitted
from autopar.searcher.inter_op import UnitCost, partition as dp_partition
from autopar.searcher.memory_budget import (LayerBudget, activation_terms, buffer_bytes, layer_budget,
                                             plan_capacity_bytes, state_bytes_per_param)
from autopar.searcher.tp_placements import one_each_proposal, planned_tp_placements, same_tp_ledger


@dataclass
class Candidate:
    evaluation: Evaluation
    stages: list[list[Unit]]
    op_placements: dict[str, str] = field(default_factory=dict)
    param_placements: dict[str, str] = field(default_factory=dict)  # tp-axis placement per parameter
    tp_realization: str = "modules"  # how the runtime realizes its tp (`autopar.capabilities.TpRealization`)
    tp_layout: PlacedLayout | None = None  # the tp collectives it was priced with, when not Megatron's analytic ones
    tp_notes: tuple[str, ...] = ()  # modules kept replicated because DTensor cannot shard them, and why

    @property
    def strategy(self) -> Strategy:
        return self.evaluation.strategy


def rank_key(evaluation: Evaluation) -> tuple:
    s = evaluation.strategy
    # Fitting plans first, the fastest first. Plans that do not fit follow, the closest to fitting first
    # (the least peak memory, as the why-not rows' `_best_of`): when nothing fits, the plan shown and
    # the "closest" the user is told of. Ties broken by a fixed order of the knobs (determinism).
    step_s = round(evaluation.step_time_s, 9)
    return (not evaluation.fits, step_s if evaluation.fits else evaluation.peak_memory_bytes, step_s, s.pp, s.tp,
            s.zero, s.microbatch, s.schedule, s.vp, s.recompute, s.sp, s.recompute_layers or (), s.cp, s.cp_kind,
            s.sp_inputs)


class Refiner:
    """Intra-op ILP per distinct unit (cached: layer instances share one solve) and the inter-op DP."""

    def __init__(self, graph, facts, cluster, global_batch, efficiency, use_ilp, fixed, capabilities,
                 cost_cache: CostCache | None = None) -> None:
        self.graph, self.facts, self.cluster = graph, facts, cluster
        self.cost_cache = cost_cache if cost_cache is not None else CostCache()
        self.capabilities = capabilities
        self.ilp_refused = 0
        self.fixed = fixed
        self.global_batch, self.efficiency = global_batch, efficiency
        self.use_ilp = use_ilp
        self.cache: dict[tuple, Any] = {}
        self.ilp_variables = 0
        self.ilp_solve_s = 0.0
        self.ilp_budgeted = 0  # solves under a layer's memory budget (the fastest sharding overflowed it)
        self._nodes: dict[str, Any] | None = None  # op name -> node, built once on first use

    def proposals(self, strategy: Strategy) -> tuple[dict[str, str], dict[str, list[str]]]:
        """The ILP's op placements and, per parameter, every tp placement its unit solves proposed
        (a tied embedding and head are solved in two units and may disagree), keyed by the names
        of each layer instance (a layer type is solved once, on its first instance)."""
        if strategy.tp == 1 or not self.use_ilp:
            return {}, {}
        try:
            from autopar.searcher.intra_op import solve_unit
        except ImportError:  # the ILP is optional: the Megatron-style propagation stands in
            return {}, {}
        op_placements: dict[str, str] = {}
        proposed: dict[str, list[str]] = {}
        weight_bytes = TensorMeta(shape=(1,), dtype=self.graph.params[0].dtype).bytes if self.graph.params else 2
        budget = layer_budget(self.facts, self.cluster, strategy, weight_bytes)
        for unit in self.facts.units:
            key = (unit.layer_type or unit.name, strategy.tp, strategy.microbatch)
            solution, solved_for = self._solved(solve_unit, key, unit, strategy, None)
            if budget is not None and unit.layer_type is not None:
                # the fastest sharding's saved bytes, per op as the budgeted row counts them
                held = unit_activation_bytes(solution.unit, strategy.microbatch, strategy.tp, False, "none",
                                             autocast=budget.autocast_saved)
                if solution.parameter_bytes * budget.param_state_multiplier \
                        + held * budget.activation_multiplier > budget.bytes:
                    # the fastest sharding overflows the layer's share: the fastest that fits, if any
                    tight, tight_for = self._solved(solve_unit, key, unit, strategy, budget)
                    if tight.status in ("optimal", "feasible"):
                        solution, solved_for = tight, tight_for
            unit_ops, unit_params = self._moved(solution, solved_for, unit)
            op_placements.update(unit_ops)
            for name, value in unit_params.items():
                if value not in proposed.setdefault(name, []):
                    proposed[name].append(value)
        return op_placements, proposed

    def _moved(self, solution, solved_for: Unit, unit: Unit) -> tuple[dict[str, str], dict[str, str]]:
        """A solve's op and parameter placements under `unit`'s names (`_instance_params`), once per
        solve and unit (the refined strategies that share a solve move it to the same units; callers copy)."""
        key = ("moved", id(solution), unit.name)  # solutions stay in `self.cache`: their ids are not reused
        if key not in self.cache:
            ops = {old.name: new.name for old, new in zip(solved_for.ops, unit.ops)}
            self.cache[key] = ({ops.get(name, name): value for name, value in solution.op_placements.items()},
                               self._instance_params(solution.param_placements, solved_for, unit))
        return self.cache[key]

    def _solved(self, solve_unit, key: tuple, unit: Unit, strategy: Strategy, budget: LayerBudget | None):
        """(solution, the instance it was solved on): one solve per layer type, tp, micro-batch and
        budget (budgets rounded to 1/64 GiB so near-equal strategies share a solve)."""
        if budget is not None:
            key = key + (round(budget.bytes / 2**24), round(budget.param_state_multiplier, 3),
                         round(budget.activation_multiplier, 3), budget.autocast_saved)
        if key not in self.cache:
            extra = {} if budget is None else dict(
                memory_budget_bytes=budget.bytes, param_state_multiplier=budget.param_state_multiplier,
                activation_multiplier=budget.activation_multiplier, autocast_saved=budget.autocast_saved)
            solution = solve_unit(unit, self.graph, tp=strategy.tp, batch=strategy.microbatch, cluster=self.cluster,
                                  dtype=self.facts.precision, efficiency=self.efficiency,
                                  tp_rules=self.capabilities.tp_rules, **extra)
            self.cache[key] = (solution, unit)
            self.ilp_variables += getattr(solution, "variables", 0)
            self.ilp_solve_s += getattr(solution, "solve_s", 0.0)
            self.ilp_budgeted += budget is not None
        return self.cache[key]

    def _instance_params(self, placements: dict[str, str], solved_for: Unit, unit: Unit) -> dict[str, str]:
        """A tied solve's parameter placements, moved from the instance it was solved on to `unit`
        (the same op reads the same parameter slot in every instance of a layer type)."""
        if solved_for.name == unit.name:
            return dict(placements)
        if self._nodes is None:
            self._nodes = {node.name: node for node in self.graph.nodes}
        nodes = self._nodes
        renamed: dict[str, str] = {}
        for old, new in zip(solved_for.ops, unit.ops):
            for a, b in zip(nodes[old.name].params, nodes[new.name].params):
                renamed.setdefault(a, b)
        missing = [name for name in placements if name not in renamed]
        if missing:
            raise AutoparError(f"layer {unit.name} has no counterpart of {missing[0]} from {solved_for.name}")
        return {renamed[name]: value for name, value in placements.items()}

    def refine(self, strategy: Strategy) -> Candidate:
        """The better of Megatron-style tensor parallelism (graph propagation, with the strategy's
        sequence parallelism) and the intra-op ILP's proposed placements, each on its best stage
        partition. An ILP proposal is priced as it runs (`placed_units`, the same evaluator), not by
        the ILP's objective; a weight with several proposals (tied) takes one, the cheaper."""
        tp_vocab = head_vocab(self.facts, strategy)  # Megatron's head is vocabulary parallel
        realize = self.capabilities.tp_realization if strategy.tp > 1 else None
        if realize is None:
            candidates = [self._refine_with(strategy, list(self.facts.units), {}, {}, vocab=tp_vocab)]
        else:
            megatron = self._dry_run_priced(strategy, {}, {})
            candidates = [megatron] if megatron is not None else []
        if strategy.sp and self.fixed.get("sp"):  # the user asked for Megatron sequence parallelism
            return candidates[0] if candidates else None
        if strategy.cp > 1:  # the runtime's cp runs the module rules' Megatron layout, not the ILP's placements
            return candidates[0] if candidates else None
        op_placements, proposed = self.proposals(strategy)
        if not op_placements:
            return candidates[0] if candidates else None
        check = self.capabilities.check_placements
        # Placements run module by module without sequence parallelism (the ILP's sequence shards do not run).
        placed_strategy = strategy.model_copy(update={"sp": False})
        runnable = 0
        for choice in one_each_proposal(proposed):
            if realize is not None and strategy.pp == 1:
                candidate = self._dry_run_priced(placed_strategy, choice, op_placements)
                if candidate is not None:
                    runnable += 1
                    candidates.append(candidate)
                continue
            planned = planned_tp_placements(choice, self.graph, self.facts, strategy.tp)  # what build_plan writes
            if check is not None and check(planned) is not None:
                continue  # the runtime could not run these placements
            if realize is not None and realize(planned, strategy.tp, False, 1).name != "modules":
                continue  # pipeline stages run the module rules only
            runnable += 1
            placed = self._placed(planned, strategy.microbatch)
            units = [placed.units[unit.name] for unit in self.facts.units]
            candidates.append(self._refine_with(
                placed_strategy, units, op_placements, planned,
                vocab=self.facts.vocab if placed.vocab_parallel_head else None, repeats=placed.recompute_repeats))
        if not runnable:
            self.ilp_refused += 1  # keep the propagation's plan
        return min(candidates, key=lambda c: rank_key(c.evaluation)) if candidates else None

    def _dry_run_priced(self, strategy: Strategy, choice: dict[str, str], op_placements: dict[str, str]
                        ) -> Candidate | None:
        """The candidate for tp placements `choice` (Megatron's where it has none), priced from what
        a dry run of them sends (`Capabilities.tp_realization`), or None when they do not run.

        Without pipeline stages and sequence parallelism, the dry run's collectives are the ledger.
        Sequence parallelism and pipeline stages run the module rules, priced by the graph's
        Megatron layout: the dry run (of the whole model, or of its shallow twins,
        `runtime.tensor_parallel.twin_dry_run`) only confirms they run, and under sequence
        parallelism that they send what that layout predicts."""
        s = strategy
        planned = planned_tp_placements(choice, self.graph, self.facts, s.tp)
        paths = tuple(self.facts.units[i].name for i in self.facts.layer_units) if s.recompute != "none" else ()
        realization = self.capabilities.tp_realization(planned, s.tp, s.sp, s.microbatch, s.recompute, paths)
        if not realization.runs or (s.compile and realization.name != "modules"):  # DTENSOR_COMPILE_PROBLEM
            return None
        planned = realization.placements if realization.placements is not None else planned
        if s.sp or s.pp > 1:
            if realization.name != "modules":
                return None
            if realization.placements is not None:
                return None  # the graph's Megatron layout prices all of it sharded
            candidate = self._refine_with(s, list(self.facts.units), op_placements, planned if choice else {},
                                          vocab=head_vocab(self.facts, s))
            if s.pp == 1 and not same_tp_ledger(candidate, realization, self.facts):
                return None
            return candidate
        layout = dry_run_units(self.graph, self._sharded_facts(planned).units, realization.collectives, planned,
                               s.microbatch, s.recompute)
        units = [layout.units[unit.name] for unit in self.facts.units]
        candidate = self._refine_with(s, units, op_placements, planned, repeats=layout.recompute_repeats,
                                      tp_step=layout.step, selective_repeats=layout.selective_repeats,
                                      tp_realization=realization.name, vocab_parallel_loss=layout.vocab_parallel_head)
        return dataclasses.replace(candidate, tp_realization=realization.name, tp_layout=layout,
                                   tp_notes=realization.notes)

    def _sharded_facts(self, planned: dict[str, str]) -> ModelFacts:
        """Facts whose ops' work divides over tp as these placements shard the matrices."""
        shapes = {p.name: p.shape for p in self.graph.params}
        sharded = frozenset(name for name, value in planned.items() if value != "R" and len(shapes[name]) == 2)
        key = ("facts", sharded)
        if key not in self.cache:
            self.cache[key] = model_facts(self.graph, sharded=sharded)
        return self.cache[key]

    def _placed(self, planned: dict[str, str], microbatch: int):
        """Units sending what the runtime sends for `planned`, with work divided as those shards divide it
        (once per placements and micro-batch: the top strategies share them)."""
        key = ("placed", tuple(sorted(planned.items())), microbatch)
        if key not in self.cache:
            self.cache[key] = placed_units(self.graph, self._sharded_facts(planned).units, planned, microbatch)
        return self.cache[key]

    def _refine_with(self, strategy: Strategy, units, op_placements, param_placements, *, vocab=None,
                     repeats=None, tp_step=(), selective_repeats=False, tp_realization="modules",
                     vocab_parallel_loss=None) -> Candidate:
        """Evaluated on the even split and on the DP's partition, each with the fewest recomputed
        layers that fit it (counts fitted on the quick ranking's estimate are fitted again here).
        `tp_realization`: how the runtime will run its tp (the module rules but where a dry run said DTensor);
        `vocab_parallel_loss`: whether a dry run's head shards the logits (None: `vocab` says)."""
        facts = dataclasses.replace(self.facts, units=tuple(units))
        fit = fit_recompute(self.fixed)
        strategy = unfitted(strategy, self.fixed)

        def evaluated(stages: list[list[Unit]]) -> Evaluation:
            def run(trial: Strategy) -> Evaluation:
                return evaluate(facts, self.cluster, trial, self.global_batch, efficiency=self.efficiency,
                                stages=stages, vocab=vocab, recompute_repeats=repeats, cache=self.cost_cache,
                                tp_step=tp_step, selective_repeats=selective_repeats, tp_realization=tp_realization,
                                vocab_parallel_loss=vocab_parallel_loss)
            return with_fewest_recomputed_layers(run(strategy), stages, run, self.cost_cache) if fit else run(strategy)

        even_stages = even_partition(facts, strategy.pp * strategy.vp)
        even = evaluated(even_stages)
        searched = self._partition(facts, strategy)
        if searched is not None and searched != even_stages:
            evaluation = evaluated(searched)
            if rank_key(evaluation) < rank_key(even):  # the DP balances an estimate: keep what simulates better
                return Candidate(evaluation, searched, op_placements, param_placements)
        return Candidate(even, even_stages, op_placements, param_placements)

    def _partition(self, facts: ModelFacts, strategy: Strategy) -> list[list[Unit]] | None:
        s = strategy
        stages = s.pp * s.vp
        if stages == 1 or s.recompute_layers is not None:  # fixed counts are per stage of the even split
            return None
        state = state_bytes_per_param(facts, s)  # and activations, as the evaluator counts them
        factor, counted = activation_terms(facts, s)
        batch = rank_batch(s)
        tp_layout = group_layout(s.tp, 1, self.cluster.gpus_per_node)
        costs, rebuilt = [], []
        gpu, cache = self.cluster.gpu, self.cost_cache
        # balanced on what the plan runs: autocast's bytes where the runtime runs autocast
        efficiency = dataclasses.replace(self.efficiency, autocast=runs_autocast(s, facts.precision))
        token = cache.token(("partition time", gpu.name, facts.precision, batch, s.tp, s.sp, efficiency))
        for unit in facts.units:
            t = cache.get(unit, (token,), lambda: unit_time(unit, gpu, facts.precision, batch=batch, tp=s.tp, sp=s.sp,
                                                            efficiency=efficiency))
            comm = 0.0
            if s.tp > 1:
                for total, count in ((t.forward_reduce_bytes, t.forward_reduces),
                                     (t.backward_reduce_bytes, t.backward_reduces)):
                    if count:
                        comm += count * collective_time_s("all_reduce", total / count, tp_layout, self.cluster)
            recompute = t.forward_s if (s.recompute == "full" and unit.layer_type) else 0.0
            policy = s.recompute if unit.layer_type else "none"
            # pipeline stages run the module rules only: a block's input cast once at tp > 1
            kept, transient = unit_kept_bytes(unit, s, policy, self.cost_cache, counted, casts_once=s.tp > 1)
            # a tied weight's copy on another rank (the head's of the embedding), as `evaluate` adds it
            copies = sum(elements / (s.tp if sharded else 1) for _, elements, sharded in unit.borrowed) \
                if s.pp > 1 else 0.0
            rebuilt.append(transient)
            costs.append(UnitCost(
                time_s=t.forward_s + t.backward_s + comm + recompute,
                state_bytes=(unit.params_on_device(s.tp) + copies) * state,
                activation_bytes=factor * kept,
                transient_bytes=factor * transient,
            ))
        # the last stage's backward holds the loss's gradients or its largest transient, the larger, that
        # transient at the activation factor and the gradients' excess over it as they are
        # (`evaluate.rank_memory`): bounded from above by the largest transient any unit brings
        loss = head_gradient_bytes(facts, s)
        largest = max((cost.transient_bytes for cost in costs), default=0.0) / factor
        if loss > 0 and costs:
            costs[-1] = dataclasses.replace(costs[-1], transient_bytes=max(
                costs[-1].transient_bytes, loss + (factor - 1) * largest))
        # so does a unit's backward (`backward_memory.stage_backward_bytes`: its gradients in flight, a
        # weight's fresh gradient beside the one it accumulates into, what recompute rebuilds for it), on
        # whichever stage holds the unit, weighed whole (the evaluator frees the units after it first); and
        # the last stage keeps each in-flight micro-batch's logits
        for index, unit in enumerate(facts.units):
            following = facts.units[index + 1] if index + 1 < len(facts.units) else None
            working = unit_working_bytes(s, unit, following, counted, cache,
                                         holds_loss=bool(facts.vocab) and following is None)
            if working > 0:
                costs[index] = dataclasses.replace(costs[index], transient_bytes=max(
                    costs[index].transient_bytes, working + rebuilt[index] + (factor - 1) * largest))
        if costs and facts.vocab:
            costs[-1] = dataclasses.replace(costs[-1], activation_bytes=costs[-1].activation_bytes
                                            + factor * last_stage_kept_bytes(facts, s, counted))
        # interleaved: chunks of 1/vp of the memory each (`inter_op`); the zero-bubble schedules
        # (other placements and orders) as before, each virtual stage priced like a 1F1B stage
        bounds = dp_partition(costs, stages, num_microbatches=s.num_microbatches,
                              vp=s.vp if s.schedule == "interleaved" else 1,
                              schedule="gpipe" if s.schedule == "gpipe" else "1f1b",
                              memory_capacity_bytes=plan_capacity_bytes(self.cluster, s) - buffer_bytes(facts, s))
        if bounds is None:
            return None
        return [list(facts.units[a:b]) for a, b in bounds]
