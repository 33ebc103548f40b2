"""Run plans on several gloo processes and the same training on one process, for parity tests.

Plans are searched once in the parent (every strategy key fixed); each worker process trains
every plan in turn on the same process group and writes its losses and gathered weights.
"""

from __future__ import annotations

import copy
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SEED = 1234
LR = 0.05  # SGD with momentum: Adam's normalization turns fp32 rounding noise in near-zero gradients
# into full-size steps, which would hide real differences behind a loose tolerance.


def make_optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)
MAX_GRAD_NORM = 1.0


def tiny_config(family: str = "gpt", **extra) -> dict:
    config = dict(layers=4, hidden=32, heads=4, vocab=96, seq_len=16)
    if family == "llama":
        config.update(kv_heads=2)
    config.update(extra)
    return config


def make_plan(model: str, overrides: dict, strategy: dict, world: int, global_batch: int, use_ilp: bool = False,
              precision: str = "fp32"):
    """The searcher's plan with every key of `strategy` fixed, for `world` processes."""
    from autopar.models import build_model

    spec = build_model(model, overrides)
    config = spec.config
    return plan_for(spec.module, spec.example_inputs(1), spec.loss_fn, name=model, seq_len=config.seq_len,
                    heads=config.heads, kv_heads=config.num_kv_heads, vocab=config.padded_vocab, strategy=strategy,
                    world=world, global_batch=global_batch, use_ilp=use_ilp, precision=precision)


def plan_for(module, example_inputs, loss_fn, *, name: str, seq_len: int, heads: int, kv_heads: int, vocab: int,
             strategy: dict, world: int, global_batch: int, use_ilp: bool = False, precision: str = "fp32"):
    """`make_plan` for any module (not only the zoo's): `autopar.plan`, the path a user's own model takes."""
    import autopar

    result = autopar.plan(module, example_inputs, cluster=autopar.load_cluster("dgx-h100", gpus=world),
                          global_batch=global_batch, strategy=strategy, loss_fn=loss_fn, precision=precision, name=name,
                          seq_len=seq_len, heads=heads, kv_heads=kv_heads, vocab=vocab, use_ilp=use_ilp)
    for key, value in strategy.items():
        assert getattr(result.chosen.strategy, key) == value, (key, result.chosen.strategy)
    if result.plan is not None:
        return result.plan
    from autopar.searcher.plan_builder import build_plan  # a plan that does not fit the H100 still runs here

    return build_plan(result.chosen, result.graph, result.facts, result.cluster)


def train_reference(module, loss_fn, data: list[torch.Tensor]) -> tuple[list[float], dict]:
    """One process trains `module` in place on whole batches (what `reference_run` does for the zoo)."""
    optimizer = make_optimizer(module.parameters())
    losses = []
    for batch in data:
        loss = loss_fn(module(batch), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in module.named_parameters()}


def train_parallel(module, loss_fn, plan, data: list[torch.Tensor], compile: bool | None = None) -> dict:
    """`run_job` for any module: parallelize, train, count the last step's collectives, gather weights."""
    from autopar.runtime.collectives import CollectiveCounter, group_axes
    from autopar.runtime.parallelize import parallelize

    if compile:
        torch._dynamo.reset()  # a graph cached by an earlier job would be reused silently
    parallel = parallelize(module, plan, loss_fn=loss_fn, seed=SEED, compile=compile)
    optimizer = make_optimizer(parallel.parameters())
    placements = parallel.executed_placements()
    losses = [parallel.train_step(batch, optimizer, max_grad_norm=MAX_GRAD_NORM) for batch in data[:-1]]
    with CollectiveCounter(group_axes(parallel)) as counter:
        losses.append(parallel.train_step(data[-1], optimizer, max_grad_norm=MAX_GRAD_NORM))
    result = {"losses": losses, "placements": placements, "pp_rank": parallel.layout.pp_rank,
              "collectives": counter.counts.as_rows(), "compile": parallel.optimizations["compile"]}
    state = parallel.full_state_dict()
    if parallel.layout.dp_rank == 0 and parallel.layout.tp_rank == 0:
        result["state"] = state
    return result


def batches(vocab: int, global_batch: int, seq_len: int, steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED + 1)
    return [torch.randint(0, vocab, (global_batch, seq_len), generator=generator) for _ in range(steps)]


def reference_run(model: str, overrides: dict, data: list[torch.Tensor]) -> tuple[list[float], dict]:
    """One process, whole batch, same init and optimizer: what every plan must reproduce."""
    from autopar.models import build_model
    from autopar.runtime.init import InitSource, materialize

    spec = build_model(model, overrides)
    module = copy.deepcopy(spec.module)
    materialize(module, InitSource(spec.module, SEED), torch.device("cpu"))
    return train_reference(module, spec.loss_fn, data)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, jobs: list[dict], outdir: str, runner) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for number, job in enumerate(jobs):
            torch.save(runner(job), Path(outdir, f"job{number}.rank{rank}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def run_job(job: dict) -> dict | None:
    from autopar.models import build_model
    from autopar.plan_schema import Plan
    from autopar.runtime.parallelize import parallelize

    plan = Plan.from_json(job["plan"])
    spec = build_model(job["model"], job["overrides"])
    parallel = parallelize(spec.module, plan, loss_fn=spec.loss_fn, seed=SEED)
    optimizer = make_optimizer(parallel.parameters())
    from autopar.runtime.collectives import CollectiveCounter, group_axes

    placements = parallel.executed_placements()
    losses = [parallel.train_step(batch, optimizer, max_grad_norm=MAX_GRAD_NORM) for batch in job["data"][:-1]]
    with CollectiveCounter(group_axes(parallel)) as counter:  # the last step: what a step sends
        losses.append(parallel.train_step(job["data"][-1], optimizer, max_grad_norm=MAX_GRAD_NORM))
    result = {"losses": losses, "placements": placements, "pp_rank": parallel.layout.pp_rank,
              "collectives": counter.counts.as_rows(), "compile": parallel.optimizations["compile"]}
    state = parallel.full_state_dict()  # a collective over the stage mesh: every rank takes part
    if parallel.layout.dp_rank == 0 and parallel.layout.tp_rank == 0:
        result["state"] = state
    return result


def run_plans(world: int, jobs: list[dict], runner=None, outdir: str | Path | None = None) -> list[list[dict]]:
    """Every job on `world` gloo processes, one spawned group for all; per job, each rank's result.

    `runner(job)` (a module-level function, default `run_job`) runs in every process; results are
    written under `outdir` (a temporary directory when None).
    """
    if outdir is None:
        with tempfile.TemporaryDirectory() as temporary:
            return run_plans(world, jobs, runner, temporary)
    runner = runner or run_job
    mp.start_processes(_worker, args=(world, _free_port(), jobs, str(outdir), runner), nprocs=world,
                       start_method="spawn")
    return [[torch.load(Path(outdir, f"job{n}.rank{r}.pt"), weights_only=False) for r in range(world)]
            for n in range(len(jobs))]
