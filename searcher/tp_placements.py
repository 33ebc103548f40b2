"""Each parameter's tensor-parallel placement in a plan, and whether the runtime runs Megatron's layout.

A candidate's tp placements are its own where the ILP proposed them and Megatron's (the graph's
propagation, `cost_models.tp_shards`) elsewhere, with the biases of split outputs split too:
`planned_tp_placements` is what `plan_builder` writes and what the search checks against the
runtime, by its module rules (`Capabilities.check_placements`) or by dry runs
(`Capabilities.tp_realization`). Every tp > 1 candidate is first ranked as Megatron's layout, so
`megatron_checked` refuses tp up front for a model whose Megatron layout does not run.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from autopar.capabilities import DTENSOR_COMPILE_PROBLEM, Capabilities
from autopar.graph.ir import OpGraph
from autopar.plan_schema import Strategy
from autopar.cost_models.collectives import head_vocab, step_collectives
from autopar.cost_models.facts import ModelFacts
from autopar.cost_models.placed_collectives import dry_run_ledger
from autopar.cost_models.recompute import recomputed_units

if TYPE_CHECKING:
    from autopar.searcher.refiner import Candidate


def module_rules_refusal(capabilities: Capabilities, graph: OpGraph, facts: ModelFacts) -> str | None:
    """Why the runtime's module rules cannot run this model's Megatron-style tp layout (statically
    checked), or None: then dry runs (`Capabilities.tp_realization`) have something to add."""
    if capabilities.tensor_parallel_refusal is not None:
        return capabilities.tensor_parallel_refusal
    check = capabilities.check_placements
    return None if check is None else check(planned_tp_placements({}, graph, facts, 2))


def megatron_checked(capabilities: Capabilities, graph: OpGraph, facts: ModelFacts) -> Capabilities:
    """Every tp > 1 candidate is ranked and refined as Megatron's layout (the ILP only adds
    alternatives to it), so a model whose Megatron layout the runtime refuses gets no tp > 1 plan
    (e.g. each Linear wrapped in a module of its own: no block pairs a column- with a row-parallel
    one). The layout is the same for every tp > 1. With dry runs at hand (`tp_realization`), the
    layout is checked by running it, per tp (`_megatron_dry_run_refusal`), not by the module rules."""
    if capabilities.tp_realization is not None:
        return dataclasses.replace(capabilities, tp_refusal=_megatron_dry_run_refusal(capabilities, graph, facts))
    check = capabilities.check_placements
    if check is None or capabilities.tensor_parallel_refusal is not None:
        return capabilities
    reason = check(planned_tp_placements({}, graph, facts, 2))
    if reason is None:
        return capabilities
    return dataclasses.replace(capabilities, tensor_parallel_refusal=(
        f"the runtime cannot run this model's Megatron-style tensor parallelism ({reason})"))


def _megatron_dry_run_refusal(capabilities: Capabilities, graph: OpGraph, facts: ModelFacts):
    """`Capabilities.tp_refusal` from dry runs of the graph's Megatron layout (one micro-batch): tp
    that does not run at all is refused with the dry run's reason, and so are sequence parallelism
    and pipeline stages where only the DTensor realization runs (they need the module rules)."""
    realize = capabilities.tp_realization
    answers: dict[tuple, str | None] = {}

    def refusal(strategy: Strategy) -> str | None:
        key = (strategy.tp, strategy.sp, strategy.pp > 1, strategy.compile)
        if key not in answers:
            placements = planned_tp_placements({}, graph, facts, strategy.tp)
            realization = realize(placements, strategy.tp, strategy.sp, 1)
            mode = f"tp={strategy.tp}" + (" with sequence parallelism" if strategy.sp else "")
            if not realization.runs:
                answers[key] = f"tensor parallelism ({mode}) does not run on this model: {realization.reason}"
            elif strategy.pp > 1 and realization.name != "modules":
                answers[key] = (f"tensor parallelism ({mode}) runs on this model only through DTensor, which the "
                                f"runtime does not combine with pipeline stages")
            elif strategy.compile and realization.name != "modules":
                answers[key] = (f"tensor parallelism ({mode}) runs on this model only through DTensor, which the "
                                f"runtime does not compile: {DTENSOR_COMPILE_PROBLEM}")
            else:
                answers[key] = None
        return answers[key]

    return refusal


def planned_tp_placements(param_placements: dict[str, str], graph: OpGraph, facts: ModelFacts,
                          tp: int) -> dict[str, str]:
    """The tp placement of every parameter of a plan: the candidate's own, Megatron's where it has
    none; the bias of a projection whose outputs are split, split with them (`output_biases`). `build_plan` writes exactly these,
    so the runtime check in `refiner.Refiner.refine` sees what will run."""
    placements = {}
    for param in graph.params:
        placement = param_placements.get(param.name)
        if placement is None:
            dim = facts.param_tp_dims.get(param.name)
            placement = f"S({dim})" if dim is not None and tp > 1 else "R"
        placements[param.name] = placement
    for bias, (weight, dim) in output_biases(graph).items():
        if placements.get(weight) == f"S({dim})":
            placements[bias] = "S(0)"
    return placements


def executed_tp_placements(param_placements: dict[str, str]) -> dict[str, str]:
    """Tp placements as the runtime executes them: a column-parallel Linear's bias splits with its
    weight (what `plan_builder` writes too)."""
    placements = dict(param_placements)
    for name, placement in param_placements.items():
        if name.endswith(".weight") and placement == "S(0)":
            placements[name.removesuffix(".weight") + ".bias"] = "S(0)"
    return placements


def output_biases(graph: OpGraph) -> dict[str, tuple[str, int]]:
    """Each bias an `addmm` adds to a product with a weight -> (that weight, the weight dimension
    holding the output features), read from the graph (not from names): a tied decoder bias follows
    the weight it is added with, and a Conv1D's (in, out) weight splits its outputs on dim 1."""
    by_name = {node.name: node for node in graph.nodes}
    shapes = {p.name: p.shape for p in graph.params}
    result: dict[str, tuple[str, int]] = {}
    for node in graph.nodes:
        if node.phase != "forward" or not node.op.startswith("aten.addmm") or len(node.input_names) < 3:
            continue
        bias_source, weight_source = node.input_names[0], node.input_names[2]
        if not bias_source.startswith("param:") or len(shapes.get(bias_source[6:], ())) != 1:
            continue
        if weight_source.startswith("param:"):
            weight, dim = weight_source[6:], 1  # read as (in, out)
        else:
            producer = by_name.get(weight_source)
            if producer is None or not producer.op.startswith("aten.t.") or not producer.inputs \
                    or not producer.inputs[0].startswith("param:"):
                continue
            weight, dim = producer.inputs[0][6:], 0  # transposed: an nn.Linear's (out, in)
        if len(shapes.get(weight, ())) == 2:
            result.setdefault(bias_source[6:], (weight, dim))
    return result


def same_tp_ledger(candidate: Candidate, realization, facts: ModelFacts) -> bool:
    """Whether the graph's Megatron layout predicts the tp collectives the dry run recorded (pp = 1)."""
    s = candidate.strategy
    ledger = step_collectives(candidate.stages, s, facts.precision, 0, seq_len=facts.seq_len,
                              vocab=head_vocab(facts, s), clip_grad_norm=False)
    predicted = {kind: (calls, round(size)) for (axis, kind), (calls, size) in ledger.items() if axis == "tp"}
    recomputed = set(recomputed_units(candidate.stages, s))
    return predicted == dry_run_ledger(realization.collectives, s.num_microbatches, recomputed)


def one_each_proposal(proposed: dict[str, list[str]], limit: int = 8) -> list[dict[str, str]]:
    """Placement sets taking one proposal per parameter (at most `limit`: tied weights are few)."""
    choices = [{}]
    for name, options in proposed.items():
        choices = [{**choice, name: option} for choice in choices for option in options][:limit]
    return choices
