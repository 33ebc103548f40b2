"""The plan search: outer choices × inter-op partition × intra-op sharding, under one cost model.

1. Enumerate every completion of the fixed keys over (dp, tp, pp, zero, recompute, micro-batch,
   schedule, vp, sp, ep, and for long sequences cp and its kind: `candidates.context_degrees`) that the
   runtime can execute (`autopar.capabilities`) and that breaks no rule,
   and rank them with the closed-form pipeline estimate on an even layer split, each recomputing
   only the layers its stages need to fit (`cost_models.recompute`).
2. For the best few: propose each distinct unit's tensor-parallel placements with the intra-op
   ILP (once per layer type, given to every instance; solved again under the layer's share of
   device memory, `searcher.memory_budget`, when the fastest sharding overflows it), keep what the
   runtime can run, rebuild the units with the collectives the runtime sends for them
   (`placed_units`), cut the units into stages with the inter-op dynamic program, and evaluate
   exactly (simulated schedule) with the evaluator Megatron's layout goes through: the plan that
   runs is the plan that was costed. Per-stage recompute counts are fitted to each partition.
   When the capabilities carry dry runs (`Capabilities.tp_realization`: the model and an example
   input at hand), each tp layout, Megatron's and the ILP's, is dry-run instead: it is kept only if
   it runs (under the module rules or through DTensor, as the plan's `tp_realization` then says)
   and, without pipeline stages and sequence parallelism, priced from the collectives the dry run
   recorded (`dry_run_units`). Context parallelism (cp > 1) runs Megatron's layout through the module
   rules: the ILP's placements are not proposed for it.
3. Keep the fastest plan that fits, the runners-up, and why-not rows for the obvious alternatives
   (`searcher.why_not`: why each loses, in numbers).
No nn.Module is touched here: inputs are the op graph, its facts, the cluster and the capabilities
(whose dry runs the runtime performs).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

from autopar.capabilities import RUNTIME_CAPABILITIES, Capabilities
from autopar.cluster import ClusterSpec
from autopar.errors import AutoparError
from autopar.graph.ir import OpGraph
from autopar.plan_schema import Strategy
from autopar.cost_models.compute import DEFAULT_EFFICIENCY, Efficiency
from autopar.cost_models.evaluate import Evaluation
from autopar.cost_models.facts import ModelFacts
from autopar.cost_models.implementation import is_runtime_profile
from autopar.cost_models.stage_costs import CostCache
from autopar.searcher.bounded import bounded_quick_evaluations
from autopar.searcher.candidates import priced_as_run, quick_evaluations
from autopar.searcher.refiner import Candidate, Refiner, rank_key
from autopar.searcher.tp_placements import megatron_checked
from autopar.searcher.why_not import WhyNot, compared_groups, why_not_rows

REFINE_TOP = 12
# A refined candidate that took this long is reported to `progress`: a tp dry run of a large model
# through DTensor takes tens of seconds (Mixtral-8x7B: about 12 s a dry run, two per candidate, on
# this project's 2-core VM); the quick ones stay silent.
SLOW_REFINE_S = 5.0


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
    ilp_budgeted: int = 0  # ILP solves under a layer's memory budget (the fastest sharding overflowed it)
    # When nothing fits without offload and offload was free, the search runs again with it: if a
    # plan fits then, the result is that search's and `without_offload` the closest plan without;
    # if none does, the result stays the first search's and `with_offload` is the closest offloaded.
    without_offload: Evaluation | None = None
    with_offload: Evaluation | None = None
    compile_choice: Any = None  # `searcher.compile_choice.CompileChoice` under `choose_compile`


def search(
    graph: OpGraph,
    facts: ModelFacts,
    cluster: ClusterSpec,
    global_batch: int,
    *,
    fixed: dict[str, Any] | None = None,
    capabilities: Capabilities = RUNTIME_CAPABILITIES,
    choose_compile: bool = False,
    **options: Any,
) -> SearchResult:
    """The best plan that fits, and the alternatives. Optimizer-state offload costs a CPU step and
    PCIe copies every step, so it is offered only when no plan without it fits (and the user left
    `offload` free): then the search runs again with offload=optimizer (`SearchResult.without_offload`,
    `with_offload`), and a why-not row says what the other side needs. `choose_compile` (with
    `compile` left free): searched eager and compiled, the faster kept (`searcher.compile_choice`)."""
    fixed = dict(fixed or {})
    if choose_compile and "compile" not in fixed:
        from autopar.searcher.compile_choice import search_choosing_compile

        return search_choosing_compile(lambda asked: search(graph, facts, cluster, global_batch, fixed=asked,
                                                            capabilities=capabilities, **options), fixed,
                                       options.get("progress"))
    result = _search_once(graph, facts, cluster, global_batch, fixed=fixed, capabilities=capabilities, **options)
    if result.best is not None or "offload" in fixed or not capabilities.supports_offload:
        return result
    try:
        offloaded = _search_once(graph, facts, cluster, global_batch, fixed={**fixed, "offload": "optimizer"},
                                 capabilities=capabilities, **options)
    except AutoparError:  # no completion of the fixed keys can offload (e.g. tp > 1 fixed)
        return result
    combined = dict(candidates=result.candidates + offloaded.candidates, search_s=result.search_s + offloaded.search_s,
                    rejected={**result.rejected, **offloaded.rejected},
                    ilp_variables=result.ilp_variables + offloaded.ilp_variables,
                    ilp_solve_s=result.ilp_solve_s + offloaded.ilp_solve_s)
    if offloaded.best is None:
        closest = offloaded.ranked[0].evaluation
        row = WhyNot("offload (offload=optimizer)", closest.strategy,
                     f"does not fit either, with optimizer states offloaded: {_overflow(closest)}", fits=False,
                     peak_memory_bytes=closest.peak_memory_bytes)
        return dataclasses.replace(result, why_not=[*result.why_not, row], with_offload=closest, **combined)
    closest = result.ranked[0].evaluation
    row = WhyNot("no offload (offload=none)", closest.strategy,
                 f"nothing fits without offload; the closest plan: {_overflow(closest)}", fits=False,
                 peak_memory_bytes=closest.peak_memory_bytes)
    return dataclasses.replace(offloaded, why_not=[row, *offloaded.why_not], without_offload=closest, **combined)


def _overflow(evaluation: Evaluation) -> str:
    """What a plan that does not fit needs: device memory (its largest part), or the node's host memory."""
    if evaluation.peak_memory_bytes > evaluation.capacity_bytes:
        worst = max(evaluation.memory, key=lambda m: m.total_bytes)
        part, size = max(worst.as_dict().items(), key=lambda item: item[1])
        return (f"needs {evaluation.peak_memory_bytes / 2**30:.1f} GiB per GPU > {evaluation.capacity_bytes / 2**30:.1f} "
                f"GiB usable ({part.replace('_', ' ')} {size / 2**30:.1f} GiB)")
    return (f"needs {evaluation.host_memory_bytes / 2**30:.1f} GiB of host memory per node > "
            f"{evaluation.host_capacity_bytes / 2**30:.1f} GiB usable")


def _search_once(
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
    exhaustive: bool = False,
    progress: Callable[[str], None] | None = None,
) -> SearchResult:
    """`exhaustive`: price every valid completion for the quick ranking, not only those that can
    change the answer (`searcher.bounded`; the same result, slower: what the tests compare it with).
    `progress`: told of each refined candidate that took `SLOW_REFINE_S` or more."""
    started = time.perf_counter()
    fixed = dict(fixed or {})
    layers = layers if layers is not None else max(len(facts.layer_units), 1)
    # A fixed implementation profile prices other software as it ran: its facts as that software
    # runs them, and Megatron's layout only (the ILP's placements are for autopar's runtime).
    facts = priced_as_run(facts, fixed)
    use_ilp = use_ilp and is_runtime_profile(fixed)
    capabilities = megatron_checked(_placements_checked_once(capabilities), graph, facts)
    cache = CostCache()  # unit costs shared by every evaluation of this search
    # without dry runs the runtime runs tp by the module rules; with them, not known before they run
    realization = "modules" if capabilities.tp_realization is None else None
    if exhaustive:
        quick, count, rejected = quick_evaluations(facts, cluster, fixed, global_batch, layers=layers,
                                                   efficiency=efficiency, supports=capabilities.supports, cache=cache,
                                                   tp_realization=realization)
    else:
        quick, count, rejected = bounded_quick_evaluations(
            facts, cluster, fixed, global_batch, layers=layers, rank_key=rank_key, keep=REFINE_TOP,
            groups=compared_groups(facts, cluster), efficiency=efficiency, supports=capabilities.supports, cache=cache,
            tp_realization=realization)
    quick.sort(key=rank_key)

    refiner = Refiner(graph, facts, cluster, global_batch, efficiency, use_ilp, fixed, capabilities, cache)
    ranked = _refined(refiner, [e.strategy for e in quick[:REFINE_TOP]], progress)
    if not ranked:
        raise AutoparError("no candidate strategy runs on this model: every tensor-parallel layout the search "
                           "refined failed its dry run; leave tp free or set tp=1")
    ranked.sort(key=lambda c: rank_key(c.evaluation))
    best = ranked[0] if ranked[0].evaluation.fits else None
    why_not = why_not_rows(ranked, quick, facts, cluster, global_batch, efficiency, best, fixed=fixed,
                           layers=layers, runners_up=top_k - 1, supports=capabilities.supports, cache=cache,
                           tp_realization=realization)
    return SearchResult(
        best=best, ranked=ranked[:top_k], why_not=why_not, candidates=count, rejected=rejected,
        search_s=time.perf_counter() - started, ilp_variables=refiner.ilp_variables,
        ilp_solve_s=refiner.ilp_solve_s, ilp_refused=refiner.ilp_refused, ilp_budgeted=refiner.ilp_budgeted,
    )


def _refined(refiner: "Refiner", strategies: list[Strategy], progress: Callable[[str], None] | None) -> list:
    """Each strategy refined (those that run), saying so to `progress` after a slow one."""
    ranked, started = [], time.perf_counter()
    for index, strategy in enumerate(strategies, start=1):
        began = time.perf_counter()
        candidate = refiner.refine(strategy)
        if candidate is not None:
            ranked.append(candidate)
        now = time.perf_counter()
        if progress is not None and now - began >= SLOW_REFINE_S:
            progress(f"refined {index} of {len(strategies)} candidates in {now - started:.0f} s ...")
    return ranked


def _placements_checked_once(capabilities: Capabilities) -> Capabilities:
    """`capabilities` whose module-rule check of tp placements answers each distinct placements once
    in this search: the Megatron layout and the ILP's proposals recur across the refined strategies
    (a check walks every module of the model), and nothing changes the model while it searches."""
    check = capabilities.check_placements
    if check is None:
        return capabilities
    answers: dict[frozenset, str | None] = {}

    def checked(placements: dict[str, str]) -> str | None:
        key = frozenset(placements.items())
        if key not in answers:
            answers[key] = check(placements)
        return answers[key]
    return dataclasses.replace(capabilities, check_placements=checked)
