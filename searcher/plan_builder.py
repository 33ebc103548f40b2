"""Turn a searched candidate into the plan file the runtime executes (autopar.plan_schema.Plan)."""

from __future__ import annotations

from autopar.cluster import ClusterSpec
from autopar.graph.ir import OpGraph
from autopar.plan_schema import (CollectiveRecord, MeshAxis, ModelInput, Plan, PredictedMetrics, Provenance, StagePlan,
                                 stage_rank)
from autopar.cost_models.collectives import step_collectives
from autopar.cost_models.placed_collectives import placed_units
from autopar.cost_models.facts import ModelFacts
from autopar.cost_models.recompute import recomputed_units
from autopar.searcher.search import Candidate
from autopar.searcher.tp_placements import planned_tp_placements


def build_plan(candidate: Candidate, graph: OpGraph, facts: ModelFacts, cluster: ClusterSpec) -> Plan:
    s = candidate.strategy
    evaluation = candidate.evaluation
    owned = _unit_modules(graph, facts)
    stage_size = s.dp * s.cp * s.tp  # a pipeline rank's contiguous block of the row-major (pp, dp, cp, tp) mesh
    stage_mesh = {"dp": s.dp, **({"cp": s.cp} if s.cp > 1 else {}), "tp": s.tp}
    stages = []
    for index, units in enumerate(candidate.stages):
        rank = stage_rank(index, s.pp, s.schedule)
        paths: list[str] = []
        for unit in units:
            paths.extend([unit.name] if unit.layer_type is not None else owned.get(unit.name, []))
        stages.append(StagePlan(
            index=index, module_paths=list(dict.fromkeys(paths)), units=[unit.name for unit in units],
            device_ids=list(range(rank * stage_size, (rank + 1) * stage_size)), mesh_shape=dict(stage_mesh),
        ))
    # ZeRO 1-3 run on FSDP2: parameters rest sharded over dp (gathered for compute; zero 3 also frees them after
    # forward), under cp over dp × cp (dp outer, cp inner: one dim-0 sharding of the flattened group)
    sharded = s.zero >= 1 and s.dp * s.cp > 1
    dp_part = "S(0)" if sharded and s.dp > 1 else "R"
    cp_part = ("S(0)" if sharded else "R") if s.cp > 1 else ""
    tp_placements = planned_tp_placements(candidate.param_placements, graph, facts, s.tp)
    param_placements = {name: dp_part + cp_part + tp_part for name, tp_part in tp_placements.items()}
    if s.ep > 1:  # each expert parameter's experts split over its ep group (Strategy.ep)
        expert_params = {name for layer in graph.moe_layers for name in layer.expert_params}
        param_placements.update({name: "S(0)" + text[len(dp_part):] for name, text in param_placements.items()
                                 if name in expert_params})
    recompute = recomputed_units(candidate.stages, s)
    return Plan(
        mesh=[MeshAxis(name="pp", size=s.pp), MeshAxis(name="dp", size=s.dp),
              *([MeshAxis(name="cp", size=s.cp)] if s.cp > 1 else []), MeshAxis(name="tp", size=s.tp)],
        strategy=s,
        stages=stages,
        param_placements=param_placements,
        op_placements=_op_placements(candidate.op_placements, s.dp),
        recompute_modules=recompute,
        model_inputs=[ModelInput(shape=list(meta.shape[1:]), dtype=meta.dtype) for meta in graph.inputs],
        tp_realization=candidate.tp_realization if s.tp > 1 else "modules",
        predicted=PredictedMetrics(
            step_time_s=evaluation.step_time_s, tokens_per_s=evaluation.tokens_per_s,
            tflops_per_gpu=evaluation.tflops_per_gpu, mfu=min(evaluation.mfu, 1.0),
            peak_memory_bytes=[int(m.total_bytes) for m in evaluation.memory],
            breakdown={k: max(v, 0.0) for k, v in evaluation.breakdown.items()},
            compute_s=list(evaluation.rank_compute_s),
            collectives=_predicted_collectives(candidate, graph, facts, tp_placements),
        ),
        provenance=Provenance(model_name=graph.model_name, model_fingerprint=graph.model_fingerprint,
                              cluster_name=cluster.name, world_size=cluster.world_size),
    )


def _unit_modules(graph: OpGraph, facts: ModelFacts) -> dict[str, list[str]]:
    """Per non-layer unit, the modules it runs whole: the outermost ones owning weights whose forward
    ops all belong to that unit (an embedding, a final norm, a head; not a container whose forward
    also runs layers, nor a module called from two units, whose weights that code reads directly)."""
    unit_of = {op.name: unit.name for unit in facts.units for op in unit.forward_ops}
    units_under: dict[str, set[str]] = {}
    for node in graph.nodes:
        if node.phase != "forward" or node.name not in unit_of:
            continue
        path = node.module_path
        while path:
            units_under.setdefault(path, set()).add(unit_of[node.name])
            path = path.rpartition(".")[0]
    weighted = set()
    for param in graph.params:
        for name in [param.name, *param.aliases]:
            path = name.rpartition(".")[0]
            while path:
                weighted.add(path)
                path = path.rpartition(".")[0]
    layers = {unit.name for unit in facts.units if unit.layer_type is not None}
    result: dict[str, list[str]] = {}
    for path in sorted(units_under):
        units = units_under[path]
        if len(units) != 1 or path not in weighted or next(iter(units)) in layers:
            continue
        unit = next(iter(units))
        kept = result.setdefault(unit, [])
        if not any(path.startswith(k + ".") for k in kept):
            kept.append(path)
    return result


def _op_placements(tp_placements: dict[str, str], dp: int) -> dict[str, str]:
    """The ILP places each op's outputs over the tp axis ("S(0)", or "R,R,R" for several outputs);
    the plan gives the primary output over the stage mesh (dp, tp): data parallel splits the batch."""
    dp_part = "S(0)" if dp > 1 else "R"
    return {name: dp_part + placement.split(",")[0] for name, placement in tp_placements.items()}


def _predicted_collectives(candidate: Candidate, graph: OpGraph, facts: ModelFacts,
                           tp_placements: dict[str, str]) -> list[list[CollectiveRecord]]:
    """Per pipeline rank, the step's ledger. The ILP's plans run per-parameter placements (module by
    module, see `placed_units`), so their tp traffic follows those placements, not the ILP's op facts."""
    s = candidate.strategy
    stages, vocab, repeats, tp_step, selective = candidate.stages, facts.vocab, None, (), False
    if candidate.tp_layout is not None:  # priced from a dry run: its units carry every tp collective
        layout = candidate.tp_layout
        vocab, repeats, tp_step, selective = None, layout.recompute_repeats, layout.step, layout.selective_repeats
    elif candidate.op_placements and s.tp > 1 and not s.sp:
        placed = placed_units(graph, facts.units, tp_placements, s.microbatch)
        stages = [[placed.units[unit.name] for unit in units] for units in candidate.stages]
        vocab = facts.vocab if placed.vocab_parallel_head else None
        repeats = placed.recompute_repeats
    result = []
    for rank in range(s.pp):
        ledger = step_collectives(stages, s, facts.precision, rank, seq_len=facts.seq_len, vocab=vocab,
                                  recompute_repeats=repeats, tp_step=tp_step, selective_repeats=selective,
                                  experts=facts.experts, attention=facts.attention)
        result.append([CollectiveRecord(axis=axis, kind=kind, calls=calls, bytes=round(size))
                       for (axis, kind), (calls, size) in ledger.items()])
    return result
