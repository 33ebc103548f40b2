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
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from autopar.errors import AutoparError

GiB = 2**30
NOISE = 0.1  # share of synthetic tokens drawn uniformly instead of from the walk
SYNTHETIC = "synthetic"
BYTE_VOCAB = 257  # the embedded corpus: 256 byte values and the end-of-document id
SYNTHETIC_STATE = "autopar-synthetic-tokens"


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


class SyntheticTokens:
    """Deterministic token batches: random walks on a fixed random permutation of the vocabulary,
    with a share of uniform noise. Learnable (a model can lower the loss well below log(vocab)),
    and identical on every rank for a given seed."""

    def __init__(self, vocab: int, global_batch: int, seq_len: int, seed: int) -> None:
        import torch

        self.vocab, self.global_batch, self.seq_len = vocab, global_batch, seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self.successor = torch.randperm(vocab, generator=self.generator)

    def next_batch(self):
        import torch

        shape = (self.global_batch, self.seq_len)
        noise = torch.randint(0, self.vocab, shape, generator=self.generator)
        jump = torch.rand(shape, generator=self.generator) < NOISE
        tokens = torch.empty(shape, dtype=torch.long)
        tokens[:, 0] = noise[:, 0]
        for t in range(1, self.seq_len):
            tokens[:, t] = torch.where(jump[:, t], noise[:, t], self.successor[tokens[:, t - 1]])
        return tokens

    def state_dict(self) -> dict[str, Any]:
        """The generator's position, JSON-able, so a resumed run draws the batches it would have drawn."""
        return {"format": SYNTHETIC_STATE, "vocab": self.vocab, "seq_len": self.seq_len,
                "generator": self.generator.get_state().tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch

        if not isinstance(state, dict) or state.get("format") != SYNTHETIC_STATE:
            raise AutoparError("the checkpoint was not trained on --data synthetic: give the --data it was trained "
                               "on, or --resume none to start fresh")
        if (state.get("vocab"), state.get("seq_len")) != (self.vocab, self.seq_len):
            raise AutoparError(f"the checkpoint's synthetic stream has vocab {state.get('vocab')} and seq_len "
                               f"{state.get('seq_len')}, this run {self.vocab} and {self.seq_len}: use the same "
                               f"model config and --seq-len, or --resume none")
        self.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))


def run_command(args: argparse.Namespace) -> int:
    env = Environment.from_env()
    try:
        return _run(args, env)
    except AutoparError as error:
        if env.rank != 0:  # every rank meets the same bad input: let rank 0 alone say so
            raise SystemExit(error.exit_code) from None
        raise


def _run(args: argparse.Namespace, env: Environment) -> int:
    from autopar.models import build_model
    from cost_models.strategy import parse_strategy

    _check_arguments(args)
    fixed = parse_strategy(args.strategy)
    cluster = _planning_cluster(args.cluster, env.world_size) if args.cluster else None
    if args.plan is None and cluster is None:
        raise AutoparError("give --plan PATH, or --cluster (e.g. --cluster local) to search a plan for this run")
    spec = build_model(args.model, args.model_config)
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
    dataset = _open_data(args.data, spec.config.vocab, seq_len, global_batch)
    if cluster is None:
        cluster = _provenance_cluster(plan, env.world_size)
    return _train(args, env, spec, plan, cluster, global_batch, seq_len, precision, dataset)


def _check_arguments(args: argparse.Namespace) -> None:
    if args.steps < 1:
        raise AutoparError(f"--steps must be at least 1, got {args.steps}")
    if args.global_batch is not None and args.global_batch < 1:
        raise AutoparError(f"--global-batch must be positive, got {args.global_batch}")
    if args.log_every < 1:
        raise AutoparError(f"--log-every must be at least 1, got {args.log_every}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise AutoparError(f"--lr must be a positive number, got {args.lr}")
    if not (args.max_grad_norm >= 0 and math.isfinite(args.max_grad_norm)):
        raise AutoparError(f"--max-grad-norm must be 0 (no clipping) or positive, got {args.max_grad_norm}")
    if args.checkpoint_every is not None:
        if args.checkpoint_dir is None:
            raise AutoparError("--checkpoint-every needs --checkpoint-dir DIR (where to save them)")
        if args.checkpoint_every < 1:
            raise AutoparError(f"--checkpoint-every must be at least 1 step, got {args.checkpoint_every}")
    if args.keep_last < 1:
        raise AutoparError(f"--keep-last {args.keep_last} would delete the checkpoint just written: give 1 or more")
    if args.async_checkpoint and args.checkpoint_dir is None:
        raise AutoparError("--async-checkpoint needs --checkpoint-dir DIR (where to save)")
    if args.resume not in ("auto", "none") and not Path(args.resume).exists():
        raise AutoparError(f"--resume {args.resume}: no such checkpoint; give auto, none or a checkpoint directory "
                           f"(e.g. CKPT_DIR/step-00000100)")
    if args.checkpoint_dir is not None and Path(args.checkpoint_dir).exists() and not Path(args.checkpoint_dir).is_dir():
        raise AutoparError(f"--checkpoint-dir {args.checkpoint_dir} is a file: give a directory")
    if args.metrics:
        directory = os.path.dirname(os.path.abspath(args.metrics))
        if not os.path.isdir(directory):
            raise AutoparError(f"cannot write {args.metrics}: directory {directory} does not exist; create it first")


def _open_data(data: str | None, vocab: int, seq_len: int, global_batch: int):
    """The dataset to train on (None: the synthetic stream), checked against the model before any
    process group or step, so every rank refuses bad data with the same line."""
    from runtime.data import TokenDataset, default_corpus

    if data == SYNTHETIC:
        return None
    if data is None:
        if vocab < BYTE_VOCAB:
            raise AutoparError(f"the embedded corpus is byte-level ({BYTE_VOCAB} token ids), the model's vocabulary "
                               f"has {vocab}: use --model-config vocab={BYTE_VOCAB} or larger, or give --data DIR "
                               f"(or --data synthetic)")
        dataset = TokenDataset(default_corpus())
    else:
        dataset = TokenDataset(data)
    dataset.check_vocab(vocab)
    samples = dataset.num_samples(seq_len)
    if samples < global_batch:
        raise AutoparError(f"dataset {dataset.path} has {dataset.num_tokens:,} tokens = {samples} samples of "
                           f"{seq_len}, fewer than one global batch of {global_batch}: use more data or a smaller "
                           f"--global-batch or --seq-len")
    return dataset


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
    from autopar.graph.capture import model_fingerprint
    from autopar.plan import load_plan

    plan = load_plan(path, expected_fingerprint=model_fingerprint(spec.module))
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
    from autopar.graph import trace
    from cost_models.facts import model_facts
    from cost_models.whatif import _check_fixed_degrees
    from searcher.plan_builder import build_plan
    from runtime.tensor_parallel import capabilities_for
    from searcher.search import search

    _check_fixed_degrees(fixed, cluster.world_size)  # before the trace
    say = env.rank == 0
    if say:
        print(f"tracing {spec.name} ({precision}, seq {seq_len}) ...", file=sys.stderr, flush=True)
    graph = trace(spec.module, spec.example_inputs(1, seq_len), loss_fn=spec.loss_fn, precision=precision,
                  name=spec.name, seq_len=seq_len)
    config = spec.config
    facts = model_facts(graph, heads=config.heads, kv_heads=config.num_kv_heads, vocab=config.vocab)
    if say:
        print(f"searching a plan for {cluster.world_size} process(es) ...", file=sys.stderr, flush=True)
    result = search(graph, facts, cluster, global_batch, fixed=fixed, capabilities=capabilities_for(spec.module))
    if result.best is None:
        closest = result.ranked[0].evaluation
        raise AutoparError(
            f"no plan fits in {closest.capacity_bytes / GiB:.1f} GiB per device for {cluster.world_size} process(es) "
            f"(the closest needs {closest.peak_memory_bytes / GiB:.1f} GiB): run on more devices, lower "
            f"--global-batch, or see `autopar plan` for the alternatives", exit_code=3)
    return build_plan(result.best, graph, facts, cluster)


def _strategy_text(s) -> str:
    text = f"dp={s.dp} tp={s.tp} pp={s.pp} microbatch={s.microbatch} x {s.num_microbatches} zero={s.zero} " \
           f"recompute={s.recompute}"
    if s.tp > 1:
        text += f" sp={str(s.sp).lower()}"
    if s.pp > 1:
        text += f" schedule={s.schedule}" + (f" vp={s.vp}" if s.vp > 1 else "")
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
    """Join torchrun's process group when there are several processes (one process: the runtime makes its own)."""
    import torch
    import torch.distributed as dist

    if env.world_size == 1 or dist.is_initialized():
        return
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise AutoparError(f"WORLD_SIZE={env.world_size} but {name} is not set: launch with "
                               f"`torchrun --nproc-per-node {env.world_size} -m autopar run ...`")
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", env.local_rank))
    else:
        dist.init_process_group("gloo")


def _train(args, env: Environment, spec, plan, cluster, global_batch: int, seq_len: int, precision: str,
           dataset) -> int:
    import torch
    import torch.distributed as dist

    from runtime.parallelize import parallelize

    had_group = dist.is_available() and dist.is_initialized()
    _init_process_group(env)
    data = checkpointer = None
    try:
        if env.world_size > 1:  # one plan for all ranks, whatever each rank's solver chose
            from autopar.plan import Plan

            shared = [plan.to_json()]
            dist.broadcast_object_list(shared, src=0)
            plan = Plan.from_json(shared[0])
        parallel = parallelize(spec.module, plan, loss_fn=spec.loss_fn, seed=args.seed, precision=precision)
        device = parallel.layout.device
        optimizer = torch.optim.AdamW(parallel.parameters(), lr=args.lr)
        if dataset is None:
            data = SyntheticTokens(spec.config.vocab, global_batch, seq_len, args.seed)
            described = (f"synthetic (random walks on a random permutation of the {spec.config.vocab}-token "
                         f"vocabulary, seed {args.seed})")
        else:
            from runtime.data import TokenLoader

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
        metrics = None
        if args.metrics and env.rank == 0:
            metrics = _MetricsFile(args.metrics, keep_through_step=first_step - 1 if first_step > 1 else None)
        run = _Run(args, env, parallel, optimizer, data, checkpointer, plan, global_batch * seq_len,
                   "synthetic" if dataset is None else str(dataset.path))
        try:
            with _StopRequest() as stop:
                run.loop(first_step, stop, num_params, peak, nominal, metrics)
        finally:
            if metrics is not None:
                metrics.close()
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
    from runtime.checkpoint import Checkpointer

    return Checkpointer(args.checkpoint_dir, keep_last=args.keep_last, async_save=args.async_checkpoint)


def _resume(args, env: Environment, checkpointer, parallel, optimizer, data) -> int:
    """Load the checkpoint `--resume` names (weights, optimizer, generators, data position); returns its
    step (0: starting fresh). Every refusal comes before the first step."""
    from runtime.checkpoint import Checkpointer, CheckpointError

    if args.resume == "none":
        return 0
    if args.resume == "auto":
        if checkpointer is None or not checkpointer.list():
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


def _json_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run's arguments as recorded in a checkpoint (what reproduces it), JSON-able values only."""
    return {key: value for key, value in vars(args).items()
            if isinstance(value, (str, int, float, bool, type(None)))}


class _StopRequest:
    """SIGTERM sets a flag; the loop finishes its step, saves a checkpoint and returns (exit 0).
    Python delivers signals on the main thread only, so elsewhere (a test's thread) nothing is installed."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc_info) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)


def _peak_flops(cluster, precision: str, world_size: int) -> float | None:
    if cluster is None:
        return None
    try:
        return cluster.gpu.peak_flops_per_s(precision) * world_size
    except AutoparError:
        return None


class _Run:
    """The training loop and what it saves; one per `autopar run`."""

    def __init__(self, args, env, parallel, optimizer, data, checkpointer, plan, tokens_per_step: int,
                 data_name: str) -> None:
        self.args, self.env, self.parallel, self.optimizer = args, env, parallel, optimizer
        self.data, self.checkpointer, self.plan = data, checkpointer, plan
        self.tokens_per_step, self.data_name = tokens_per_step, data_name

    def local_rows(self):
        """This dp rank's rows of the next global batch, on the model's device."""
        if isinstance(self.data, SyntheticTokens):  # every rank draws the whole batch
            return self.parallel.local_batch(self.data.next_batch())
        tokens, _ = self.data.next()
        return tokens

    def step(self) -> float:
        """`ParallelModel.train_step` on this rank's rows alone (the loader reads no other rank's)."""
        parallel, optimizer = self.parallel, self.optimizer
        loss_sum = parallel.forward_backward(self.local_rows())
        parallel.sync_gradients()
        if self.args.max_grad_norm > 0:
            parallel.clip_grad_norm_(self.args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return parallel.global_loss(loss_sum)

    def save(self, step: int) -> None:
        extra = {"step": step, "data": self.data.state_dict(), "data_name": self.data_name,
                 "plan": self.plan.to_json(), "config": _json_config(self.args), "world_size": self.env.world_size}
        path = self.checkpointer.save(step, self.parallel, self.optimizer, extra)
        if self.env.rank == 0:
            verb = "saving" if self.checkpointer.async_save else "saved"
            print(f"{verb} checkpoint {path}", flush=True)

    def stop_requested(self, stop: _StopRequest, device) -> bool:
        """Whether any rank got SIGTERM: all ranks stop after the same step (one scalar all-reduce)."""
        if self.env.world_size == 1:
            return stop.requested
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if stop.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def loop(self, first_step: int, stop: _StopRequest, num_params: int, peak: float | None, nominal: bool,
             metrics) -> None:
        import torch
        import torch.distributed as dist

        args, env = self.args, self.env
        device = self.parallel.layout.device
        cuda = device.type == "cuda"
        every = args.checkpoint_every
        started = time.perf_counter()
        interval_steps = 0
        for step in range(first_step, args.steps + 1):
            loss = self.step()
            interval_steps += 1
            if not math.isfinite(loss):
                raise AutoparError(f"the loss is {loss} at step {step}: lower --lr, set --max-grad-norm, or use "
                                   f"--precision fp32/bf16", exit_code=1)
            if step % args.log_every == 0:
                if cuda:
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - started
                tokens_per_s = self.tokens_per_step * interval_steps / elapsed if elapsed > 0 else 0.0
                peak_memory = 0
                if cuda:  # the largest peak of any rank
                    value = torch.tensor([torch.cuda.max_memory_allocated(device)], dtype=torch.float64, device=device)
                    dist.all_reduce(value, op=dist.ReduceOp.MAX)
                    peak_memory = int(value.item())
                mfu = 6 * num_params * tokens_per_s / peak if peak else None
                if env.rank == 0:
                    memory = f"  peak memory {peak_memory / GiB:.2f} GiB" if cuda else ""
                    shown = "n/a" if mfu is None else f"{mfu:.1%}" + (" (nominal)" if nominal else "")
                    print(f"step {step:>6}  loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s  MFU {shown}{memory}",
                          flush=True)
                    if metrics is not None:
                        metrics.write({"step": step, "loss": loss, "tokens_per_s": tokens_per_s, "mfu": mfu,
                                       "mfu_nominal": nominal, "peak_memory_bytes": peak_memory,
                                       "data": self.data_name})
            stopping = self.stop_requested(stop, device)
            due = step == args.steps or stopping or (every is not None and step % every == 0)
            if self.checkpointer is not None and due:
                self.save(step)
            if stopping:
                if env.rank == 0:
                    saved = "checkpoint saved" if self.checkpointer is not None else "no --checkpoint-dir, nothing saved"
                    print(f"SIGTERM: stopped after step {step} ({saved})", flush=True)
                return
            if step % args.log_every == 0:  # the next interval starts after any save
                started = time.perf_counter()
                interval_steps = 0


class _MetricsFile:
    """JSONL, one complete line per write (a single write call each), so a crash never leaves half a line."""

    def __init__(self, path: str, keep_through_step: int | None = None) -> None:
        kept = _records_through(path, keep_through_step) if keep_through_step is not None else b""
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
            if kept:
                os.write(self.fd, kept)
        except OSError as error:
            raise AutoparError(f"cannot write {path}: {error.strerror}; choose a writable location") from None
        self.path = path

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record) + "\n").encode()
        try:
            written = os.write(self.fd, line)
        except OSError as error:
            raise AutoparError(f"cannot write {self.path}: {error.strerror}; check free space", exit_code=1) from None
        if written != len(line):
            raise AutoparError(f"short write to {self.path}: check free space", exit_code=1)

    def close(self) -> None:
        os.close(self.fd)


def _records_through(path: str, last_step: int) -> bytes:
    """A resumed run's metrics continue the file: the lines up to the checkpoint's step are kept,
    those after it (the steps the resumed run trains again) dropped."""
    try:
        lines = Path(path).read_bytes().splitlines(keepends=True)
    except OSError:
        return b""
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    return b"".join(kept)
