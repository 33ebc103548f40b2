"""The report model from a search result: the one place that reads the searcher's and cost model's objects."""

from __future__ import annotations

import re
from typing import Any

from autopar.cluster import ClusterSpec
from autopar.errors import AutoparError
from autopar.plan_schema import Plan, Strategy, stage_rank
from autopar.report.model import (MESH_ORDER, Breakdown, ClusterInfo, CompileChoiceInfo, EvaluationReport, LinkInfo, MemoryParts,
                                  MeshAxisInfo, MeshInfo, MeshLinks, MfuBasis, PipelineInfo, Predicted, Report,
                                  SearchStats, ShardingRow, StageRow, WhyNotRow)
from autopar.searcher.why_not import critical_rank


def build_report(result: Any, *, model: str, cluster: ClusterSpec, global_batch: int, seq_len: int | None,
                 fixed: dict[str, Any], precision: str | None = None, plan: Plan | None = None,
                 hash_bytes_per_s: float | None = None) -> Report:
    """`result`: a searcher.search.SearchResult; `plan`: the plan built from its best candidate;
    `hash_bytes_per_s`: sha256 throughput for the checkpoint cost (default: measured on this machine)."""
    chosen = result.best or result.ranked[0]
    evaluation = chosen.evaluation
    mine = evaluation_report(chosen)
    mesh = mesh_info(evaluation.strategy, cluster)
    return Report(
        **dict(mine),
        model=model, precision=precision,
        cluster=ClusterInfo(name=cluster.name, gpu=cluster.gpu.name, world_size=cluster.world_size,
                            gpus_per_node=cluster.gpus_per_node, num_nodes=cluster.num_nodes),
        global_batch=global_batch, seq_len=seq_len, fixed=fixed, capacity_bytes=evaluation.capacity_bytes,
        mfu_basis=mfu_basis(cluster, precision),
        search=SearchStats(candidates=result.candidates, seconds=round(result.search_s, 3),
                           ilp_variables=result.ilp_variables, ilp_solve_s=round(result.ilp_solve_s, 3),
                           ilp_budgeted=result.ilp_budgeted, rejected=result.rejected,
                           compile_choice=_compile_choice(result.compile_choice)),
        alternatives=[evaluation_report(c) for c in result.ranked if c is not chosen],
        why_not=[WhyNotRow(label=w.label, strategy=w.strategy, reason=w.reason, slowdown=w.slowdown, fits=w.fits,
                           peak_memory_bytes=w.peak_memory_bytes, global_batch=w.global_batch)
                 for w in result.why_not],
        mesh=mesh,
        pipeline=pipeline_info(mine, evaluation) if evaluation.pipeline is not None else None,
        plan=plan,
        sharding=None if plan is None else sharding_rows(
            plan.param_placements, [axis.name for axis in plan.mesh if axis.name != "pp"]),
        checkpoint=checkpoint_cost(chosen, cluster, hash_bytes_per_s),
    )


def _compile_choice(choice) -> CompileChoiceInfo | None:
    if choice is None:
        return None
    return CompileChoiceInfo(compiled=choice.compiled, eager_step_time_s=choice.eager_step_time_s,
                             compiled_step_time_s=choice.compiled_step_time_s, refusal=choice.refusal,
                             line=choice.line())


# What the save-time model does not price: a fixed part per save (DCP's save planning and its
# collectives, fsync, the sha256 manifest's own write, the directory rename). Measured on the 2-core
# CPU VM the tests run on (`autopar run --checkpoint-every 1`, one process, 2026-11-24): 0.18-0.46 s
# per save for a 0.7 MB checkpoint (0.001 s predicted) and 0.40-0.53 s for 39 MB (0.105 s
# predicted); the harden work on issue #19 saw about 1 s for 1.4 MB under torchrun. No cited or
# cross-validated figure exists for a cluster's file system, and this VM's would not carry over, so
# it is named rather than added.
CHECKPOINT_LEAVES_OUT = ("a fixed cost per save (save planning and its collectives, fsync, the manifest, the rename), "
                         "measured at 0.2-0.5 s per save on a 2-core CPU VM, so small checkpoints take longer than "
                         "predicted")
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weight + AdamW exp_avg + exp_avg_sq (runtime: fp32 master weights)


def checkpoint_cost(candidate: Any, cluster: ClusterSpec, hash_bytes_per_s: float | None = None):
    """The chosen strategy's checkpoint: bytes per GPU of each pipeline rank (the rank's parameters
    over its dp × cp × tp GPUs), the save time of cost_models/checkpoint.py, and Young/Daly's interval at
    Llama 3's failure rate. None when the candidate has no stages to count parameters from."""
    from autopar.cost_models import checkpoint as cost
    from autopar.report.model import CheckpointCost

    s = candidate.evaluation.strategy
    stages = getattr(candidate, "stages", None)
    if not stages:
        return None
    if hash_bytes_per_s is None:
        from autopar.runtime.checkpoint.files import sha256_bytes_per_s

        hash_bytes_per_s = sha256_bytes_per_s()
    params = [0] * s.pp
    for index, units in enumerate(stages):
        params[stage_rank(index, s.pp, s.schedule)] += sum(unit.params for unit in units)
    per_gpu = s.dp * s.cp * s.tp
    bytes_per_rank = [CHECKPOINT_BYTES_PER_PARAM * count / per_gpu for count in params]
    per_device = [bytes_per_rank[rank // per_gpu] for rank in range(s.pp * per_gpu)]
    ranks_per_node = min(cluster.gpus_per_node, len(per_device))
    nodes = [sum(per_device[start:start + ranks_per_node]) for start in range(0, len(per_device), ranks_per_node)]
    save_s = cost.save_time_s(per_device, ranks_per_node, cluster.node_storage_write_bytes_per_s, hash_bytes_per_s)
    mtbf_s = cost.mean_time_between_failures_s(len(per_device))
    step_s = candidate.evaluation.step_time_s
    return CheckpointCost(
        checkpoint_bytes=CHECKPOINT_BYTES_PER_PARAM * sum(params), bytes_per_rank=bytes_per_rank,
        busiest_node_bytes=max(nodes), node_storage_write_bytes_per_s=cluster.node_storage_write_bytes_per_s,
        hash_bytes_per_s=hash_bytes_per_s, save_time_s=save_s, failures_per_gpu_hour=cost.LLAMA3_FAILURES_PER_GPU_HOUR,
        mtbf_s=mtbf_s, interval_s=cost.checkpoint_interval_s(save_s, mtbf_s),
        checkpoint_every=cost.checkpoint_every_steps(save_s, step_s, mtbf_s) if step_s > 0 else 1,
        leaves_out=CHECKPOINT_LEAVES_OUT)


def evaluation_report(candidate: Any) -> EvaluationReport:
    """A searcher Candidate (its evaluation and the units of each stage) as report data."""
    e = candidate.evaluation
    layers = [sum(unit.layer_type is not None for unit in units) for units in candidate.stages] \
        if getattr(candidate, "stages", None) and len(candidate.stages) == len(e.stages) else [None] * len(e.stages)
    return EvaluationReport(
        strategy=e.strategy, fits=e.fits,
        predicted=Predicted(
            step_time_s=e.step_time_s, tokens_per_s=e.tokens_per_s, tflops_per_gpu=e.tflops_per_gpu, mfu=e.mfu,
            peak_memory_bytes=e.peak_memory_bytes,
            peak_memory_bytes_per_stage=[m.total_bytes for m in e.memory],
            memory_breakdown_bytes=[MemoryParts(**m.as_dict()) for m in e.memory],
            breakdown=Breakdown(**e.breakdown), compute_s_per_stage=list(e.rank_compute_s),
            memory_headroom_bytes=e.headroom_bytes, host_memory_bytes=e.host_memory_bytes,
            host_capacity_bytes=e.host_capacity_bytes),
        stages=[StageRow(index=st.index, rank=st.rank, units=list(st.units), forward_s=st.forward_s,
                         backward_s=st.backward_s, backward_weight_s=st.backward_weight_s,
                         recomputed_layers=st.recomputed_layers, layers=count)
                for st, count in zip(e.stages, layers)],
    )


def mfu_basis(cluster: ClusterSpec, precision: str | None) -> MfuBasis | None:
    """The peak MFU is measured against; `nominal` when the cluster's figures are placeholders."""
    if precision is None:
        return None
    gpu = cluster.gpu
    try:
        peak = gpu.peak_flops_per_s(precision)
    except AutoparError:
        return None
    source = (gpu.source or "the cluster file").split(";")[0]  # the peak's source (kernel figures follow it)
    return MfuBasis(gpu=gpu.name, dtype=precision, peak_tflops=peak / 1e12, source=source,
                    nominal="nominal" in source.lower() or "placeholder" in source.lower())


def mesh_info(strategy: Strategy, cluster: ClusterSpec) -> MeshInfo:
    """Each axis's groups: size, stride, how many nodes one spans and the link it talks over."""
    sizes = {"pp": strategy.pp, "dp": strategy.dp, "cp": strategy.cp, "tp": strategy.tp}
    order = [axis for axis in MESH_ORDER if axis != "cp" or strategy.cp > 1]
    per_node = cluster.gpus_per_node
    intra, inter = getattr(cluster, "intra_node", None), getattr(cluster, "inter_node", None)
    links = MeshLinks(
        intra_node=None if intra is None else LinkInfo(name=intra.name,
                                                       bandwidth_bytes_per_s=intra.effective_bandwidth_bytes_per_s),
        inter_node=None if inter is None else LinkInfo(name=inter.name,
                                                       bandwidth_bytes_per_s=inter.effective_bandwidth_bytes_per_s))
    axes: dict[str, MeshAxisInfo] = {}
    stride = 1
    for axis in reversed(order):
        size = sizes[axis]
        first = [k * stride for k in range(size)]
        nodes = len({rank // per_node for rank in first})
        if size == 1:
            link = "none"
        elif nodes == 1:
            link = links.intra_node.name if links.intra_node else "intra-node"
        else:
            link = links.inter_node.name if links.inter_node else "inter-node"
        axes[axis] = MeshAxisInfo(size=size, stride=stride, groups=cluster.world_size // size, nodes_per_group=nodes,
                                  within_node=nodes == 1, link=link, first_group=first)
        stride *= size
    return MeshInfo(order=order, world_size=cluster.world_size, gpus_per_node=per_node,
                    num_nodes=cluster.num_nodes, links=links, axes={axis: axes[axis] for axis in order})


def pipeline_info(chosen: EvaluationReport, evaluation: Any) -> PipelineInfo:
    """The schedule's inputs and results, enough to redraw it.

    The transfer time between stages is read off the simulated timeline (the first micro-batch's
    forward reaches stage 1 that long after stage 0 finished it). The evaluator keeps the
    per-rank gradient-sync and optimizer times internal; the breakdown holds the critical rank's,
    so other ranks get the optimizer scaled by their optimizer-state bytes and the same exposed
    sync, capped so that no rank ends after the step.
    """
    s, p, pipe = chosen.strategy, chosen.predicted, evaluation.pipeline
    p2p_s = 0.0
    if s.pp > 1:
        first = {(x.kind, x.stage, x.microbatch): x for x in pipe.timeline}
        if ("F", 0, 0) in first and ("F", 1, 0) in first:
            p2p_s = max(first[("F", 1, 0)].start_s - first[("F", 0, 0)].end_s, 0.0)
    ends, busy = list(pipe.rank_end_s), list(pipe.rank_busy_s)
    critical = critical_rank(evaluation)
    states = [m.optimizer_states for m in p.memory_breakdown_bytes]
    if s.offload != "none":  # the CPU steps every rank's shard; offload runs with pp = 1 (autopar.capabilities)
        optimizer = [p.breakdown.cpu_optimizer] * s.pp
        offload = [p.breakdown.offload_transfer] * s.pp
    else:
        optimizer = [p.breakdown.optimizer * (x / states[critical] if states[critical] else 1.0) for x in states]
        offload = [0.0] * s.pp
    sync_critical = max(p.step_time_s - ends[critical] - offload[critical] - optimizer[critical], 0.0)
    sync = [sync_critical if r == critical else
            max(min(sync_critical, p.step_time_s - ends[r] - offload[r] - optimizer[r]), 0.0) for r in range(s.pp)]
    return PipelineInfo(schedule=s.schedule, pp=s.pp, vp=s.vp, num_microbatches=s.num_microbatches, p2p_s=p2p_s,
                        makespan_s=pipe.step_time_s, rank_busy_s=busy, rank_end_s=ends, critical_rank=critical,
                        exposed_sync_s=sync, optimizer_s=optimizer,
                        offload_transfer_s=offload if s.offload != "none" else [])


_INDEX = re.compile(r"\.(\d+)\.")


def sharding_rows(param_placements: dict[str, str], axes: list[str]) -> list[ShardingRow]:
    """Placements per module, repeated layers with identical placements folded into one row."""
    modules: dict[str, dict[str, str]] = {}
    for name, placement in param_placements.items():
        match = _INDEX.search(name)
        if match:
            module, leaf = f"{name[:match.start()]}.{int(match.group(1))}", name[match.end():]
        else:
            module, _, leaf = name.rpartition(".")
            module = module or name
        modules.setdefault(module, {})[leaf] = placement
    runs: list[dict[str, Any]] = []
    for module, params in modules.items():
        prefix, _, index = module.rpartition(".")
        last = runs[-1] if runs else None
        if index.isdigit() and last and last["prefix"] == prefix and last["params"] == params \
                and last["last"] == int(index) - 1:
            last["last"] = int(index)
            last["count"] += 1
            continue
        numbered = index.isdigit()
        runs.append({"prefix": prefix if numbered else module, "first": int(index) if numbered else None,
                     "last": int(index) if numbered else None, "count": 1, "params": params})
    rows = []
    for run in runs:
        if run["first"] is None:
            label = run["prefix"]
        elif run["count"] == 1:
            label = f"{run['prefix']}.{run['first']}"
        else:
            label = f"{run['prefix']}.{run['first']}–{run['last']}"
        rows.append(ShardingRow(modules=label, axes=axes, **run))
    return rows
