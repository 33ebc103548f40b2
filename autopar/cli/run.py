"""`autopar run`: train a model (the zoo's or a user's factory) under a plan, on the processes torchrun
started (or on this one).

The plan is either read from `--plan` or searched on the fly for the running world size: under
torchrun rank 0 searches and broadcasts the plan (or its refusal), so all ranks run one plan and the
dry runs and the solver run once.

Data (`autopar/cli/run_data.py`): a prepared token dataset (`--data DIR`), by default the embedded
byte-level corpus of the Python standard library for zoo models; each dp rank's `TokenLoader` reads
only its own rows. `--data synthetic` keeps the old random-walk stream (every rank draws the whole
batch from `--seed`). A factory model trains on batches shaped like its example input, or on its
own `batches` hook (`autopar/cli/run_inputs.py`).

Checkpoints (`--checkpoint-dir`): weights, optimizer, generators and, in `extra`, the step, the
data position, the plan and the run's arguments. A checkpoint loads under any plan, so a job can
resume on another world size or strategy. SIGTERM (a scheduler's preemption notice) finishes the
current step, saves, and exits 0, so the job's next launch with `--resume auto` loses no step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.cli.run_config import RunConfig, run_config
from autopar.cli.run_data import TrainingData, choose_data
from autopar.cli.run_plan import (
    batch_text,
    load_run_plan,
    plan_global_batch,
    planning_cluster,
    print_dry_run,
    provenance_cluster,
    search_plan,
    strategy_text,
)
from autopar.cli.run_profile import check_profile_outputs, train_with_profile
from autopar.runtime.training_loop import Reporter, StopRequest, TrainingLoop


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
    import torch.distributed as dist

    env = Environment.from_env()
    had_group = dist.is_available() and dist.is_initialized()
    try:
        return _run(run_config(args), env)
    except RuntimeError as error:
        if env.world_size == 1 or getattr(args, "debug", False) or not _peer_failure(error):
            raise
        first_line = str(error).strip().splitlines()[0]
        print(f"autopar: rank {env.rank}: a peer process failed ({first_line[:200]}); under torchrun "
              f"--max-restarts the job restarts from the last checkpoint", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        if not had_group and dist.is_available() and dist.is_initialized():  # made by the search or training
            dist.destroy_process_group()


def _peer_failure(error: RuntimeError) -> bool:
    """Whether a collective failed because another rank died (gloo or NCCL wording)."""
    text = str(error)
    return any(sign in text for sign in ("Connection closed by peer", "Connection reset by peer",
                                         "remote worker", "NCCL communicator was aborted"))


@dataclass
class Launch:
    """What `_run` settled before any process group: the model, its plan and what it trains on."""

    spec: Any  # autopar.models.ModelSpec
    plan: Any  # autopar.plan_schema.Plan
    cluster: Any  # for MFU; None when unknown
    global_batch: int  # samples per optimizer step
    batch: str  # "global batch 8 x seq 16"
    precision: str
    data: TrainingData


def _run(args: RunConfig, env: Environment) -> int:
    from autopar.cost_models.strategy import parse_strategy
    from autopar.models import build_model

    args.check()
    check_profile_outputs(args)
    fixed = parse_strategy(args.strategy)
    # --compile/--no-compile: searched and priced so (the strategy's `compile` key wins); neither, on a
    # GPU: searched both ways, the faster kept (`search_plan`)
    choose_compile = args.compile is None and "compile" not in fixed and _on_gpu()
    if args.compile is not None and fixed.get("compile", args.compile) != args.compile:
        flag = "--compile" if args.compile else "--no-compile"
        raise AutoparError(f"{flag} disagrees with --strategy compile={str(fixed['compile']).lower()}: drop one")
    if args.compile is not None and args.plan is None:
        fixed.setdefault("compile", args.compile)
    cluster = planning_cluster(args.cluster, env.world_size) if args.cluster else None
    if args.plan is None and cluster is None:
        raise AutoparError("give --plan PATH, or --cluster (e.g. --cluster local) to search a plan for this run")
    spec = build_model(args.model, args.model_overrides)
    seq_len = args.seq_len or spec.default_seq_len
    example = _model_input(spec, seq_len)
    precision = args.precision or _default_precision()

    if args.plan is not None:
        plan = load_run_plan(args.plan, spec, fixed)
        if args.compile is False and plan.strategy.compile:
            raise AutoparError(f"plan {args.plan} was priced compiled (its memory counts what the compiled step "
                               f"keeps): drop --no-compile, or re-plan with `autopar plan --strategy compile=false`")
        global_batch = plan_global_batch(plan, args.global_batch)
    else:
        if args.global_batch is None:
            raise AutoparError("--global-batch is needed to search a plan (samples per optimizer step)")
        plan = search_plan(spec, example, cluster, fixed, args.global_batch, seq_len, precision, env,
                           choose_compile=choose_compile)
        global_batch = args.global_batch

    batch = batch_text(spec, example, global_batch, seq_len)
    if args.dry_run:
        print_dry_run(plan, spec.name, env, batch, precision)
        return 0
    if plan.strategy.ep > 1 and args.checkpoint_dir is not None:  # expert slices have no resharding yet
        raise AutoparError(f"checkpoints of expert-parallel runs (ep={plan.strategy.ep}) are not implemented yet: drop "
                           f"--checkpoint-dir, or plan with ep=1")
    if plan.provenance.world_size != env.world_size:  # before any process group: one line, no hang
        want, have = plan.provenance.world_size, env.world_size
        running = "this is one process" if have == 1 else f"{have} are running"
        raise AutoparError(f"the plan needs {want} processes but {running}: launch with `torchrun --nproc-per-node "
                           f"{want} -m autopar run ...`, or re-plan with `autopar plan --gpus {have}`")
    data = choose_data(args.data, spec, example, seq_len, global_batch, args.seed)
    if cluster is None:
        cluster = provenance_cluster(plan, env.world_size)
    return _train(args, env, Launch(spec, plan, cluster, global_batch, batch, precision, data))


def _model_input(spec, seq_len: int):
    """The model's one input at batch 1 (on meta); refusals in one line before anything runs."""
    if spec.config is None:  # a user's factory: its example input and loss
        from autopar.cli.run_inputs import factory_input

        return factory_input(spec, seq_len)
    (example,) = spec.example_inputs(1, seq_len)  # checks seq_len against the model's maximum
    if seq_len < 2:
        raise AutoparError(f"--seq-len {seq_len}: next-token training needs at least 2 tokens per sequence")
    return example


def _default_precision() -> str:
    return "bf16" if _on_gpu() else "fp32"


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _train(args, env: Environment, launch: Launch) -> int:
    from autopar.runtime.launch import init_process_group
    from autopar.runtime.parallelize import parallelize

    spec, plan, precision = launch.spec, launch.plan, launch.precision
    init_process_group(env.world_size, env.rank, env.local_rank)  # a no-op when the search made it
    data = checkpointer = None
    try:
        parallel = parallelize(spec.module, plan, loss_fn=spec.loss_fn, seed=args.seed, precision=precision,
                               compile=plan.strategy.compile if args.compile is None else args.compile)
        device = parallel.layout.device
        optimizer = parallel.build_optimizer(args.lr)
        data = launch.data.open(parallel)
        checkpointer = _checkpointer(args)
        first_step = _resume(args, env, checkpointer, parallel, optimizer, data) + 1
        if first_step > args.steps:
            if env.rank == 0:
                print(f"the checkpoint is at step {first_step - 1}, --steps is {args.steps}: nothing to train "
                      f"(raise --steps to continue)", flush=True)
            return 0
        num_params = sum(p.numel() for p in spec.module.parameters())  # unique parameters, tied ones once
        peak = _peak_flops(launch.cluster, precision, env.world_size)
        nominal = device.type != "cuda" or launch.cluster is None or launch.cluster.gpu.name == "cpu"
        if env.rank == 0:
            steps = f"steps {first_step}-{args.steps}" if first_step > 1 else f"{args.steps} steps"
            print(f"training {spec.name} ({num_params:,} parameters, {precision}) for {steps} on "
                  f"{env.world_size} process(es), {device.type}: {strategy_text(plan.strategy)}; {launch.batch}; "
                  f"data: {launch.data.describe()}", flush=True)
            if peak:
                print(_mfu_basis_text(launch.cluster, precision, device.type, nominal), flush=True)
            print("runtime: " + "; ".join(f"{k} {v}" for k, v in parallel.optimizations.items()), flush=True)
            if args.compile is True and not plan.strategy.compile:
                print("note: the plan was priced without compile; `autopar plan --strategy compile=true` prices it",
                      flush=True)
        loop = TrainingLoop(args, env, parallel, optimizer, data, checkpointer, plan,
                            launch.global_batch * launch.data.tokens_per_sample, launch.data.name)
        reporter = Reporter(args, env.rank, first_step)
        try:
            with StopRequest() as stop, compile_failure_said(plan.strategy.compile if args.compile is None
                                                             else args.compile):
                if args.profile_steps:
                    train_with_profile(loop, first_step, stop, reporter, num_params, peak, nominal)
                else:
                    last = loop.loop(first_step, args.steps, stop, reporter, num_params, peak, nominal)
                    # the plan's step time, where it was priced for this run's hardware (not a nominal stand-in)
                    priced_here = launch.cluster is not None and plan.provenance.cluster_name == launch.cluster.name
                    predicted = plan.predicted.step_time_s if plan.predicted and priced_here and not nominal else None
                    reporter.say(loop.clock.summary(first_step, last, predicted))
        finally:
            reporter.close()
        if checkpointer is not None:
            checkpointer.close()  # publishes an async save still in flight
    finally:
        if data is not None:
            data.close()
    return 0


@contextlib.contextmanager
def compile_failure_said(compiled: bool):
    """torch.compile meets a model at its first steps (dynamo traces it, inductor builds its kernels, the
    backward compiles at the first backward): a failure there is a model this torch cannot compile, said
    in one line with the eager way out, not a traceback mid-run (`--debug` shows it)."""
    try:
        yield
    except Exception as error:
        from torch._dynamo.exc import TorchDynamoException

        if not compiled or not isinstance(error, TorchDynamoException):
            raise
        cause = getattr(error, "inner_exception", None) or error  # a backend's own error, inside dynamo's
        first = (str(cause).strip().splitlines() or [""])[0][:200]
        raise AutoparError(f"torch.compile failed on this model ({type(error).__name__}, {type(cause).__name__}: "
                           f"{first}); train it eager: --no-compile, or a plan with compile=false") from error


def _checkpointer(args):
    if args.checkpoint_dir is None:
        return None
    from autopar.runtime.checkpoint.checkpointer import Checkpointer

    return Checkpointer(args.checkpoint_dir, keep_last=args.keep_last, async_save=args.async_checkpoint)


def _resume(args, env: Environment, checkpointer, parallel, optimizer, data) -> int:
    """Load the checkpoint `--resume` names (weights, optimizer, generators, data position); returns its
    step (0: starting fresh). Every refusal comes before the first step."""
    from autopar.runtime.checkpoint.checkpointer import Checkpointer, CheckpointError

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
    return mfu_text(basis, flops="6 × parameters × tokens/s per device (as planned: the plan's model FLOPs per "
                                 "token, attention included, as its predicted MFU counts them)", running_on=running_on)


def _peak_flops(cluster, precision: str, world_size: int) -> float | None:
    if cluster is None:
        return None
    try:
        return cluster.gpu.peak_flops_per_s(precision) * world_size
    except AutoparError:
        return None
