"""How `autopar run` gets its plan: read from `--plan` and checked against the run's flags, or
searched through `autopar.plan` for the running world size exactly as `autopar plan` searches it
(the model's example input and loss); and what `--dry-run` prints of it."""

from __future__ import annotations

import sys
from typing import Any

from autopar.errors import AutoparError

GiB = 2**30


def planning_cluster(name: str, world_size: int):
    """The cluster preset or file, shaped to the running world size."""
    from autopar.cluster import ClusterSpec, load_cluster, size_cluster

    cluster = load_cluster(name)
    if cluster.world_size == world_size:
        return cluster
    if cluster.gpu.name == "cpu":  # the nominal CPU cluster: N processes on one machine
        return ClusterSpec.model_validate({**cluster.model_dump(), "gpus_per_node": world_size, "num_nodes": 1})
    return size_cluster(cluster, world_size)


def provenance_cluster(plan, world_size: int):
    """For MFU: the cluster the plan names, when it is a preset (a file's cluster may be anywhere)."""
    from autopar.cluster import CLUSTER_PRESETS, LOCAL

    name = plan.provenance.cluster_name
    if name.lower() not in CLUSTER_PRESETS and name.lower() != LOCAL:
        return None
    try:
        return planning_cluster(name, world_size)
    except AutoparError:
        return None


def load_run_plan(path: str, spec, fixed: dict[str, Any]):
    from autopar.plan_checks import load_plan_for_model

    plan = load_plan_for_model(path, spec.module)
    clashes = [f"{key}={value} (the plan has {key}={getattr(plan.strategy, key)})"
               for key, value in fixed.items() if getattr(plan.strategy, key) != value]
    if clashes:
        raise AutoparError(f"--strategy disagrees with plan {path}: {', '.join(clashes)}; drop --strategy or "
                           f"re-run `autopar plan --strategy ...`")
    return plan


def plan_global_batch(plan, requested: int | None) -> int:
    s = plan.strategy
    needed = s.dp * s.microbatch * s.num_microbatches
    if requested is not None and requested != needed:
        raise AutoparError(f"--global-batch {requested}, but the plan needs dp x microbatch x micro-batches = "
                           f"{s.dp} x {s.microbatch} x {s.num_microbatches} = {needed}: drop --global-batch or "
                           f"re-plan with `autopar plan --global-batch {requested}`")
    return needed


def search_plan(spec, example, cluster, fixed: dict[str, Any], global_batch: int, seq_len: int, precision: str,
                env, choose_compile: bool = False):
    """`autopar.plan` on the model's example input (one sample) and loss, as `autopar plan` calls it;
    `choose_compile`: searched eager and compiled, the plan predicted faster kept (`searcher.compile_choice`).
    Under torchrun only rank 0 searches (dry runs and the solver run once, not once per process) and
    broadcasts the plan, or its one-line refusal, which every rank then raises."""
    def search(say):
        return searched_plan(spec, example, cluster, fixed, global_batch, seq_len, precision, say, choose_compile)

    if env.world_size == 1:
        return search(_to_stderr)
    import torch.distributed as dist

    from autopar.plan_schema import Plan
    from autopar.runtime.launch import init_process_group

    init_process_group(env.world_size, env.rank, env.local_rank)
    # rank 0's answer: a plan's json, or a refusal and its exit code; a bug's stays as preset below
    outcome: list[Any] = [None, "rank 0's plan search failed: see rank 0's output", 1]
    try:
        if env.rank == 0:
            try:
                outcome = [search(_to_stderr).to_json(), None, 0]
            except AutoparError as error:
                outcome = [None, str(error), error.exit_code]
    finally:  # also when rank 0's search raised something else: the others then stop with one line
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise AutoparError(outcome[1], exit_code=outcome[2])
    return Plan.from_json(outcome[0])


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def searched_plan(spec, example, cluster, fixed, global_batch, seq_len, precision, say, choose_compile=False):
    """The plan `autopar.plan` finds, or its refusal as an error; choosing compile, one line on which
    way was kept and why."""
    import autopar

    result = autopar.plan(spec.module, (example,), cluster=cluster, global_batch=global_batch,
                          strategy=fixed, loss_fn=spec.loss_fn, precision=precision, name=spec.name, seq_len=seq_len,
                          progress=say, choose_compile=choose_compile)
    if not result.fits:
        raise AutoparError(f"{result.no_fit_reason()}; see `autopar plan` for the alternatives", exit_code=3)
    if result.compile_choice is not None:
        say(f"{result.compile_choice.line()} (--compile/--no-compile decide instead)")
    return result.plan


def strategy_text(s) -> str:
    text = f"dp={s.dp} tp={s.tp} pp={s.pp} microbatch={s.microbatch} x {s.num_microbatches} zero={s.zero} " \
           f"recompute={s.recompute}"
    if s.recompute_layers is not None:
        text += f" recompute_layers={'/'.join(str(k) for k in s.recompute_layers)}"
    if s.tp > 1:
        text += f" sp={str(s.sp).lower()}" + (f" sp_inputs={s.sp_inputs}" if s.sp and s.sp_inputs != "gathered" else "")
    if s.pp > 1:
        text += f" schedule={s.schedule}" + (f" vp={s.vp}" if s.vp > 1 else "")
    if s.offload != "none":
        text += f" offload={s.offload}"
    if s.ep > 1:
        text += f" ep={s.ep}"
    if s.cp > 1:
        text += f" cp={s.cp} cp_kind={s.cp_kind}"
    if s.compile:
        text += " compile=true"
    return text


def batch_text(spec, example, global_batch: int, seq_len: int) -> str:
    """`global batch 8 x seq 16` for a zoo LM, `global batch 8 of float32[32]` for a factory's input."""
    if spec.config is not None:
        return f"global batch {global_batch} x seq {seq_len}"
    from autopar.cli.run_inputs import sample_text

    return f"global batch {global_batch} of {sample_text(example)}"


def print_dry_run(plan, model: str, env, batch: str, precision: str) -> None:
    if env.rank != 0:
        return
    mesh = " x ".join(f"{axis.name}={axis.size}" for axis in plan.mesh)
    print(f"model     {model} ({precision}), {batch}")
    print(f"strategy  {strategy_text(plan.strategy)}")
    print(f"mesh      {mesh} ({plan.provenance.world_size} processes, planned for cluster "
          f"{plan.provenance.cluster_name})")
    for stage in plan.stages:
        paths = stage.module_paths
        shown = (", ".join(paths) if len(paths) <= 4
                 else f"{paths[0]}, {paths[1]}, ... {paths[-1]} ({len(paths)} modules)")
        print(f"stage {stage.index}   devices {stage.device_ids}: {shown}")
    if plan.predicted is not None:
        p = plan.predicted
        memory = ", ".join(f"{m / GiB:.2f}" for m in p.peak_memory_bytes)
        print(f"predicted step {p.step_time_s * 1e3:.1f} ms, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}, "
              f"peak memory per pipeline rank {memory} GiB")
    else:
        print("predicted (the plan has no prediction)")
    if plan.provenance.world_size != env.world_size:
        print(f"note: the plan is for {plan.provenance.world_size} processes, this launch has {env.world_size}: "
              f"launch with torchrun --nproc-per-node {plan.provenance.world_size}")
    print("dry run: nothing trained")
