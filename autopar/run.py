"""`autopar run`: train a zoo model under a plan, on the processes torchrun started (or on this one).

The plan is either read from `--plan` or searched on the fly for the running world size; every
rank searches the same inputs, and rank 0's plan is broadcast so that all ranks run one plan even if
a solver broke a tie differently.

Data: a prepared token dataset (`--data DIR`), by default the embedded byte-level corpus of the
Python standard library; each dp rank's `TokenLoader` reads only its own rows. `--data synthetic`
keeps the old random-walk stream (every rank draws the whole batch from `--seed`), for tests that
need a stream independent of the dataset.

Checkpoints (`--checkpoint-dir`): weights, optimizer, generators and, in `extra`, the step, the
data position, the plan and the run's arguments. A checkpoint loads under any plan, so a job can
resume on another world size or strategy. SIGTERM (a scheduler's preemption notice) finishes the
current step, saves, and exits 0, so the job's next launch with `--resume auto` loses no step.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.run_config import RunConfig, run_config
from autopar.run_data import SYNTHETIC, SyntheticTokens, open_data
from autopar.run_loop import Reporter, StopRequest, TrainingLoop
from autopar.run_profile import check_profile_outputs, train_with_profile

GiB = 2**30


@dataclass
class Environment:
    """What torchrun tells this process (or a lone process's defaults)."""

    world_size: int
    rank: int
    local_rank: int

    @classmethod
    def from_env(cls) -> Environment:
        def number(name: str, default: int) -> int:
            text = os.environ.get(name, "")
            if not text:
                return default
            try:
                return int(text)
            except ValueError:
                raise AutoparError(f"environment variable {name}={text!r} is not a whole number: "
                                   f"launch with torchrun or unset it") from None

        world = number("WORLD_SIZE", 1)
        rank = number("RANK", 0)
        if world < 1 or not 0 <= rank < world:
            raise AutoparError(f"WORLD_SIZE={world} and RANK={rank} do not describe a process group: "
                               f"launch with torchrun or unset them")
        return cls(world_size=world, rank=rank, local_rank=number("LOCAL_RANK", rank))


def run_command(args: argparse.Namespace) -> int:
    env = Environment.from_env()
    try:
        return _run(run_config(args), env)
    except RuntimeError as error:
        if env.world_size == 1 or getattr(args, "debug", False) or not _peer_failure(error):
            raise
        first_line = str(error).strip().splitlines()[0]
        print(f"autopar: rank {env.rank}: a peer process failed ({first_line[:200]}); under torchrun "
              f"--max-restarts the job restarts from the last checkpoint", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def _peer_failure(error: RuntimeError) -> bool:
    """Whether a collective failed because another rank died (gloo or NCCL wording)."""
    text = str(error)
    return any(sign in text for sign in ("Connection closed by peer", "Connection reset by peer",
                                         "remote worker", "NCCL communicator was aborted"))


def _run(args: RunConfig, env: Environment) -> int:
    from autopar.models import build_model
    from autopar.cost_models.strategy import parse_strategy

    args.check()
    check_profile_outputs(args)
    fixed = parse_strategy(args.strategy)
    cluster = _planning_cluster(args.cluster, env.world_size) if args.cluster else None
    if args.plan is None and cluster is None:
        raise AutoparError("give --plan PATH, or --cluster (e.g. --cluster local) to search a plan for this run")
    spec = build_model(args.model, args.model_overrides)
    if spec.config is None or spec.loss_fn is None:
        raise AutoparError(f"autopar run trains zoo language models for now (gpt, llama, presets), not {args.model!r}: "
                           f"synthetic token data needs the model's vocabulary")
    seq_len = args.seq_len or spec.default_seq_len
    spec.example_inputs(1, seq_len)  # checks seq_len against the model's maximum
    if seq_len < 2:
        raise AutoparError(f"--seq-len {seq_len}: next-token training needs at least 2 tokens per sequence")
    precision = args.precision or _default_precision()

    if args.plan is not None:
        plan = _load(args.plan, spec, fixed)
        global_batch = _plan_global_batch(plan, args.global_batch)
    else:
        if args.global_batch is None:
            raise AutoparError("--global-batch is needed to search a plan (sequences per optimizer step)")
        plan = _search(spec, cluster, fixed, args.global_batch, seq_len, precision, env)
        global_batch = args.global_batch

    if args.dry_run:
        _print_dry_run(plan, spec.name, env, global_batch, seq_len, precision)
        return 0
    if plan.provenance.world_size != env.world_size:  # before any process group: one line, no hang
        want, have = plan.provenance.world_size, env.world_size
        running = "this is one process" if have == 1 else f"{have} are running"
        raise AutoparError(f"the plan needs {want} processes but {running}: launch with `torchrun --nproc-per-node "
                           f"{want} -m autopar run ...`, or re-plan with `autopar plan --gpus {have}`")
    dataset = open_data(args.data, spec.config.vocab, seq_len, global_batch)
    if cluster is None:
        cluster = _provenance_cluster(plan, env.world_size)
    return _train(args, env, spec, plan, cluster, global_batch, seq_len, precision, dataset)


def _default_precision() -> str:
    import torch

    return "bf16" if torch.cuda.is_available() else "fp32"


def _planning_cluster(name: str, world_size: int):
    """The cluster preset or file, shaped to the running world size."""
    from autopar.cluster import ClusterSpec, load_cluster, size_cluster

    cluster = load_cluster(name)
    if cluster.world_size == world_size:
        return cluster
    if cluster.gpu.name == "cpu":  # the nominal CPU cluster: N processes on one machine
        return ClusterSpec.model_validate({**cluster.model_dump(), "gpus_per_node": world_size, "num_nodes": 1})
    return size_cluster(cluster, world_size)


def _provenance_cluster(plan, world_size: int):
    """For MFU: the cluster the plan names, when it is a preset (a file's cluster may be anywhere)."""
    from autopar.cluster import CLUSTER_PRESETS, LOCAL

    name = plan.provenance.cluster_name
    if name.lower() not in CLUSTER_PRESETS and name.lower() != LOCAL:
        return None
    try:
        return _planning_cluster(name, world_size)
    except AutoparError:
        return None


def _load(path: str, spec, fixed: dict[str, Any]):
    from autopar.plan_schema import load_plan

    plan = load_plan(path, model=spec.module)
    clashes = [f"{key}={value} (the plan has {key}={getattr(plan.strategy, key)})"
               for key, value in fixed.items() if getattr(plan.strategy, key) != value]
    if clashes:
        raise AutoparError(f"--strategy disagrees with plan {path}: {', '.join(clashes)}; drop --strategy or "
                           f"re-run `autopar plan --strategy ...`")
    return plan


def _plan_global_batch(plan, requested: int | None) -> int:
    s = plan.strategy
    needed = s.dp * s.microbatch * s.num_microbatches
    if requested is not None and requested != needed:
        raise AutoparError(f"--global-batch {requested}, but the plan needs dp x microbatch x micro-batches = "
                           f"{s.dp} x {s.microbatch} x {s.num_microbatches} = {needed}: drop --global-batch or "
                           f"re-plan with `autopar plan --global-batch {requested}`")
    return needed


def _search(spec, cluster, fixed: dict[str, Any], global_batch: int, seq_len: int, precision: str, env: Environment):
    import autopar

    say = (lambda message: print(message, file=sys.stderr, flush=True)) if env.rank == 0 else None
    result = autopar.plan(spec.module, spec.example_inputs(1, seq_len), cluster=cluster, global_batch=global_batch,
                          strategy=fixed, loss_fn=spec.loss_fn, precision=precision, name=spec.name, seq_len=seq_len,
                          progress=say)
    if not result.fits:
        raise AutoparError(f"{result.no_fit_reason()}; see `autopar plan` for the alternatives", exit_code=3)
    return result.plan


def _strategy_text(s) -> str:
    text = f"dp={s.dp} tp={s.tp} pp={s.pp} microbatch={s.microbatch} x {s.num_microbatches} zero={s.zero} " \
           f"recompute={s.recompute}"
    if s.recompute_layers is not None:
        text += f" recompute_layers={'/'.join(str(k) for k in s.recompute_layers)}"
    if s.tp > 1:
        text += f" sp={str(s.sp).lower()}"
    if s.pp > 1:
        text += f" schedule={s.schedule}" + (f" vp={s.vp}" if s.vp > 1 else "")
    if s.offload != "none":
        text += f" offload={s.offload}"
    return text


def _print_dry_run(plan, model: str, env: Environment, global_batch: int, seq_len: int, precision: str) -> None:
    if env.rank != 0:
        return
    mesh = " x ".join(f"{axis.name}={axis.size}" for axis in plan.mesh)
    print(f"model     {model} ({precision}), global batch {global_batch} x seq {seq_len}")
    print(f"strategy  {_strategy_text(plan.strategy)}")
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


def _init_process_group(env: Environment) -> None:
    from autopar.runtime.launch import init_process_group

    init_process_group(env.world_size, env.rank, env.local_rank)


def _train(args, env: Environment, spec, plan, cluster, global_batch: int, seq_len: int, precision: str,
           dataset) -> int:
    import torch
    import torch.distributed as dist

    from autopar.runtime.parallelize import parallelize

    had_group = dist.is_available() and dist.is_initialized()
    _init_process_group(env)
    data = checkpointer = None
    try:
        if env.world_size > 1:  # one plan for all ranks, whatever each rank's solver chose
            from autopar.plan_schema import Plan

            shared = [plan.to_json()]
            dist.broadcast_object_list(shared, src=0)
            plan = Plan.from_json(shared[0])
        parallel = parallelize(spec.module, plan, loss_fn=spec.loss_fn, seed=args.seed, precision=precision,
                               compile=args.compile)
        device = parallel.layout.device
        optimizer = torch.optim.AdamW(parallel.parameters(), lr=args.lr)
        if dataset is None:
            data = SyntheticTokens(spec.config.vocab, global_batch, seq_len, args.seed)
            described = (f"synthetic (random walks on a random permutation of the {spec.config.vocab}-token "
                         f"vocabulary, seed {args.seed})")
        else:
            from autopar.runtime.data import TokenLoader

            data = TokenLoader(dataset, seq_len, global_batch, dp_rank=parallel.layout.dp_rank,
                               dp_size=parallel.layout.size("dp"), seed=args.seed, device=device)
            described = f"{dataset.path} ({dataset.num_tokens:,} tokens, order seed {args.seed})"
        checkpointer = _checkpointer(args)
        first_step = _resume(args, env, checkpointer, parallel, optimizer, data) + 1
        if first_step > args.steps:
            if env.rank == 0:
                print(f"the checkpoint is at step {first_step - 1}, --steps is {args.steps}: nothing to train "
                      f"(raise --steps to continue)", flush=True)
            return 0
        num_params = sum(p.numel() for p in spec.module.parameters())  # unique parameters, tied ones once
        peak = _peak_flops(cluster, precision, env.world_size)
        nominal = device.type != "cuda" or cluster is None or cluster.gpu.name == "cpu"
        if env.rank == 0:
            steps = f"steps {first_step}-{args.steps}" if first_step > 1 else f"{args.steps} steps"
            print(f"training {spec.name} ({num_params:,} parameters, {precision}) for {steps} on "
                  f"{env.world_size} process(es), {device.type}: {_strategy_text(plan.strategy)}; global batch "
                  f"{global_batch} x seq {seq_len}; data: {described}", flush=True)
            if peak:
                print(_mfu_basis_text(cluster, precision, device.type, nominal), flush=True)
        loop = TrainingLoop(args, env, parallel, optimizer, data, checkpointer, plan, global_batch * seq_len,
                            SYNTHETIC if dataset is None else str(dataset.path))
        reporter = Reporter(args, env.rank, first_step)
        try:
            with StopRequest() as stop:
                if args.profile_steps:
                    train_with_profile(loop, first_step, stop, reporter, num_params, peak, nominal)
                else:
                    loop.loop(first_step, args.steps, stop, reporter, num_params, peak, nominal)
        finally:
            reporter.close()
        if checkpointer is not None:
            checkpointer.close()  # publishes an async save still in flight
    finally:
        if data is not None and dataset is not None:
            data.close()
        if not had_group and dist.is_initialized():  # whoever made it here (this call or parallelize)
            dist.destroy_process_group()
    return 0


def _checkpointer(args):
    if args.checkpoint_dir is None:
        return None
    from autopar.runtime.checkpoint import Checkpointer

    return Checkpointer(args.checkpoint_dir, keep_last=args.keep_last, async_save=args.async_checkpoint)


def _resume(args, env: Environment, checkpointer, parallel, optimizer, data) -> int:
    """Load the checkpoint `--resume` names (weights, optimizer, generators, data position); returns its
    step (0: starting fresh). Every refusal comes before the first step."""
    from autopar.runtime.checkpoint import Checkpointer, CheckpointError

    if args.resume == "none":
        return 0
    if args.resume == "auto":
        if checkpointer is None or checkpointer.is_empty():
            return 0
        try:
            extra = checkpointer.load("latest", parallel, optimizer)
        except CheckpointError as error:
            if error.path != checkpointer.directory:  # a checkpoint found but unusable (another model, ...)
                raise
            if env.rank == 0:
                print(f"autopar: note: no complete checkpoint in {checkpointer.directory}: starting fresh",
                      file=sys.stderr, flush=True)
            return 0
        source = checkpointer
    else:
        source = checkpointer or Checkpointer(Path(args.resume).parent)
        extra = source.load(args.resume, parallel, optimizer)
    step = extra.get("step") if isinstance(extra, dict) else None
    if not isinstance(step, int) or "data" not in extra:
        raise AutoparError(f"checkpoint {source.loaded.path} was not written by `autopar run` (no step or data "
                           f"position): give one of its checkpoints, or --resume none")
    data.load_state_dict(extra["data"])
    if env.rank == 0:
        print(f"resumed from {source.loaded.path} (step {step})", flush=True)
    return step


def _mfu_basis_text(cluster, precision: str, device_type: str, nominal: bool) -> str:
    """What the logged MFU is relative to (the same wording as the plan report's)."""
    from autopar.report.build import mfu_basis
    from autopar.report.views import mfu_text

    basis = mfu_basis(cluster, precision)
    running_on = device_type if nominal and basis is not None and not basis.nominal else None
    return mfu_text(basis, flops="6 × parameters × tokens/s per device", running_on=running_on)


def _peak_flops(cluster, precision: str, world_size: int) -> float | None:
    if cluster is None:
        return None
    try:
        return cluster.gpu.peak_flops_per_s(precision) * world_size
    except AutoparError:
        return None
