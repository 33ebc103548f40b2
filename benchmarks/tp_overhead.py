"""Step time of tensor parallelism: autopar's two realizations against a hand-written composition.

Issue #17 (item 6, for tp): the same tp=2 plan on the zoo GPT, trained on 2 gloo processes (CPU) by
  (a) hand-written: TorchTitan-style `parallelize_module` (vocabulary-parallel embedding and head,
      column/row-parallel q/k/v/out and fc1/fc2), the loss under `loss_parallel`, gradient clipping;
  (b) autopar, "modules" realization (the module rules; what the search picks where they run);
  (c) autopar, "dtensor" realization (DTensor through the model's own forward), the same plan.
Each variant: 3 warm-up steps, then `--steps` steps interleaved with the other variants' (one step of
each in turn); the median step time per variant (the slower of the two ranks) and the ratios b/a and
c/a are printed with the machine they ran on. The goal in the
issue is <= 1.05; the CPU figures say what DTensor's per-op dispatch costs where compute is cheap.

    python benchmarks/tp_overhead.py [--steps 20] [--model-config layers=2,hidden=256,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GLOBAL_BATCH = 8
WARMUP = 3
LR = 0.05


def _plan(overrides: dict, realization: str):
    from autopar.cluster import load_cluster
    from autopar.cost_models.facts import model_facts
    from autopar.graph import trace
    from autopar.models import build_model
    from autopar.runtime.tensor_parallel.realization import capabilities_for
    from autopar.searcher.plan_builder import build_plan
    from autopar.searcher.search import search

    spec = build_model("gpt", overrides)
    config = spec.config
    graph = trace(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, name="gpt", seq_len=config.seq_len)
    facts = model_facts(graph, heads=config.heads, kv_heads=config.num_kv_heads, vocab=config.padded_vocab)
    cluster = load_cluster("dgx-h100", gpus=2)
    fixed = dict(dp=1, tp=2, pp=1, sp=False, zero=0, recompute="none", microbatch=GLOBAL_BATCH)
    result = search(graph, facts, cluster, GLOBAL_BATCH, fixed=fixed, use_ilp=False,
                    capabilities=capabilities_for(spec.module))
    plan = build_plan(result.best or result.ranked[0], graph, facts, cluster)
    return plan.model_copy(update={"tp_realization": realization})


def _autopar_step(overrides: dict, plan_json: str):
    from autopar.models import build_model
    from autopar.plan_schema import Plan
    from autopar.runtime.parallelize import parallelize

    spec = build_model("gpt", overrides)
    parallel = parallelize(spec.module, Plan.from_json(plan_json), loss_fn=spec.loss_fn, seed=0)
    optimizer = torch.optim.SGD(parallel.parameters(), lr=LR)
    return lambda batch: parallel.train_step(batch, optimizer, max_grad_norm=1.0)


def _hand_written_step(overrides: dict):
    """What one writes by hand, TorchTitan-style: plan the styles per module path, parallelize, train."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                   parallelize_module)

    from autopar.models import build_model
    from autopar.runtime.init import InitSource, materialize

    spec = build_model("gpt", overrides)
    model = spec.module
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    styles = {"embed": RowwiseParallel(input_layouts=Replicate()),
              "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for index in range(len(model.layers)):
        prefix = f"layers.{index}"
        styles.update({f"{prefix}.attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")})
        styles.update({f"{prefix}.attn.out_proj": RowwiseParallel(), f"{prefix}.mlp.fc1": ColwiseParallel(),
                       f"{prefix}.mlp.fc2": RowwiseParallel()})
    parallelize_module(model, mesh, styles)
    model.head.weight = model.embed.weight  # tied, both sharded over the vocabulary
    materialize(model, InitSource(build_model("gpt", overrides).module, 0), torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step(batch):
        with loss_parallel():
            loss = spec.loss_fn(model(batch), batch)
            loss.backward()
        _clip_grad_norm(list(model.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.full_tensor().item()

    return step


def _clip_grad_norm(params: list, max_norm: float) -> None:
    """Global norm in one scalar all-reduce: sharded gradients summed over ranks, replicated ones once."""
    from torch.distributed.tensor import DTensor

    sharded = torch.zeros(())
    replicated = torch.zeros(())
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor) and any(p.is_shard() for p in grad.placements):
            sharded += grad.to_local().pow(2).sum()
        else:
            replicated += (grad.to_local() if isinstance(grad, DTensor) else grad).pow(2).sum()
    dist.all_reduce(sharded)
    scale = (max_norm / ((sharded + replicated).sqrt() + 1e-6)).clamp(max=1.0)
    for param in params:
        if param.grad is not None:
            (param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad).mul_(scale)


def _worker(rank: int, world: int, port: int, overrides: dict, plans: dict, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        generator = torch.Generator().manual_seed(1)
        data = [torch.randint(0, overrides["vocab"], (GLOBAL_BATCH, overrides["seq_len"]), generator=generator)
                for _ in range(WARMUP + steps)]
        variants = {"hand_written": _hand_written_step(overrides),
                    **{name: _autopar_step(overrides, text) for name, text in plans.items()}}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for step in variants.values():
            for batch in data[:WARMUP]:
                step(batch)
        for batch in data[WARMUP:]:  # variants interleaved step by step: a busy machine slows all alike
            for name, step in variants.items():
                dist.barrier()
                started = time.perf_counter()
                step(batch)
                times[name].append(time.perf_counter() - started)
        torch.save(times, Path(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", default="layers=2,hidden=256,heads=4,vocab=512,seq_len=128")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    overrides = {key: int(value) for key, value in (item.split("=") for item in args.model_config.split(","))}
    plans = {name: _plan(overrides, name).to_json() for name in ("modules", "dtensor")}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(2, port, overrides, plans, args.steps, out), nprocs=2, start_method="spawn")
        ranks = [torch.load(Path(out, f"rank{rank}.pt")) for rank in range(2)]
    median = {name: statistics.median(max(a, b) for a, b in zip(ranks[0][name], ranks[1][name]))
              for name in ranks[0]}
    result = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                         f"torch {torch.__version__}, gloo world 2, 1 thread per rank",
              "model": args.model_config, "steps": args.steps, "median_step_s": median,
              "modules_over_hand_written": median["modules"] / median["hand_written"],
              "dtensor_over_hand_written": median["dtensor"] / median["hand_written"]}
    print(f"machine: {result['machine']}")
    print(f"gpt {args.model_config}, tp=2, global batch {GLOBAL_BATCH}, {args.steps} timed steps")
    for name, seconds in median.items():
        print(f"  {name:13s} median step {seconds * 1e3:8.1f} ms")
    print(f"ratio modules/hand_written {result['modules_over_hand_written']:.3f}")
    print(f"ratio dtensor/hand_written {result['dtensor_over_hand_written']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
