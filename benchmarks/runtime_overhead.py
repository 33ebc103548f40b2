"""Step time of autopar's runtime against a hand-written TorchTitan-style composition of the same plan.

For each mode the searcher's plan (every key fixed) runs twice on the same processes, model, batch
and initial weights: through `autopar.parallelize` (its `train_step`), and through torch's
primitives composed directly here: `parallelize_module` with Colwise/Rowwise/SequenceParallel
styles read off the plan's placements, `fully_shard` per block, DistributedDataParallel for plain
dp, and a `PipelineStage` + 1F1B schedule for pp. Both sides skip gradient clipping. Steps alternate
in blocks (autopar, hand-written, ...) so drift hits both; the median step is compared.
Goal (issue #17): autopar / hand-written ≤ 1.05 for dp, zero3, tp, tp+sp, pp and pp×tp. The first
step's losses of the two sides must agree (the hand-written side runs the same plan).

    python benchmarks/runtime_overhead.py [--modes dp,zero3,tp,tp_sp,pp,pp_tp] [--steps 12]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODEL = "llama"
CONFIG = "layers=4,hidden=256,heads=8,kv_heads=8,vocab=1024,seq_len=128"
GLOBAL_BATCH = 8
LR = 0.01
SEED = 0
MODES = {
    "dp": dict(dp=2, tp=1, pp=1, zero=0, microbatch=4),
    "zero3": dict(dp=2, tp=1, pp=1, zero=3, microbatch=4),
    "tp": dict(dp=1, tp=2, pp=1, zero=0, sp=False, microbatch=8),
    "tp_sp": dict(dp=1, tp=2, pp=1, zero=0, sp=True, microbatch=8),
    "pp": dict(dp=1, tp=1, pp=2, zero=0, schedule="1f1b", microbatch=2),
    "pp_tp": dict(dp=1, tp=2, pp=2, zero=0, sp=False, schedule="1f1b", microbatch=2),
}


def plan_for(mode: str):
    import autopar
    from autopar.models import build_model

    strategy = dict(MODES[mode], recompute="none")
    world = strategy["dp"] * strategy["tp"] * strategy["pp"]
    spec = build_model(MODEL, CONFIG)
    result = autopar.plan(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, precision="fp32",
                          cluster=autopar.load_cluster("dgx-h100", gpus=world), global_batch=GLOBAL_BATCH,
                          strategy=strategy, use_ilp=False)
    return result.plan or _unfit(result)


def _unfit(result):
    raise SystemExit(f"runtime_overhead: {result.no_fit_reason()}")


# --- the hand-written composition --------------------------------------------------------------
def hand_written(plan, spec, mesh, device):
    """(step(batch) -> loss, optimizer) for `plan`, composed from torch's primitives directly."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import loss_parallel

    s = plan.strategy
    model = copy.deepcopy(spec.module).to_empty(device=device)
    _copy_reference_weights(model, spec)
    pp_rank = mesh["pp"].get_local_rank()
    if s.pp > 1:
        model = _stage(model, plan.stages[pp_rank].module_paths)
    vocab_parallel = False
    if s.tp > 1:
        vocab_parallel = _tensor_parallel(model, mesh["tp"], plan, s.sp, last_stage=pp_rank == s.pp - 1,
                                          pipelined=s.pp > 1)
    if s.zero >= 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=s.zero >= 3)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=s.zero >= 3)
    elif s.dp > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, process_group=mesh["dp"].get_group())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    rows = s.microbatch * s.num_microbatches
    dp_rank = mesh["dp"].get_local_rank()
    reports = pp_rank == s.pp - 1 and mesh["tp"].get_local_rank() == 0

    def global_loss(local_sum: float) -> float:
        """The mean loss on every rank: one scalar all-reduce, as autopar's step ends."""
        value = torch.tensor([local_sum if reports else 0.0])
        dist.all_reduce(value)
        return value.item() / (s.dp * s.num_microbatches)

    if s.pp > 1:
        stage = PipelineStage(model, pp_rank, s.pp, device, group=mesh["pp"].get_group())
        schedule = Schedule1F1B(stage, n_microbatches=s.num_microbatches, loss_fn=spec.loss_fn)

        def step(batch):
            local = batch[dp_rank * rows:(dp_rank + 1) * rows]
            losses = []
            if pp_rank == 0:
                schedule.step(local)
            else:
                schedule.step(target=local, losses=losses)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return global_loss(sum(float(loss.detach()) for loss in losses))

        return step

    def step(batch):
        local = batch[dp_rank * rows:(dp_rank + 1) * rows]
        total = 0.0
        micro = local.chunk(s.num_microbatches)
        for index, x in enumerate(micro):
            context = loss_parallel() if vocab_parallel else _null()
            with context:
                loss = spec.loss_fn(model(x), x)
                (loss / s.num_microbatches).backward()
            total += float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return global_loss(total)

    return step


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _copy_reference_weights(model, spec) -> None:
    """The initial weights autopar gives every plan (seeded per module path)."""
    from autopar.runtime.init import InitSource, materialize

    reference = copy.deepcopy(spec.module)
    materialize(reference, InitSource(spec.module, SEED), torch.device("cpu"))
    model.load_state_dict(reference.state_dict())
    for name, buffer in reference.named_buffers():
        model.get_buffer(name).copy_(buffer)


def _stage(model, paths: list[str]):
    keep = set(paths)
    for name in list(model.layers.keys()):
        if f"layers.{name}" not in keep:
            del model.layers[name]
    for part in ("embed", "final_norm", "head"):
        if part not in keep:
            setattr(model, part, None)
    return model


def _tensor_parallel(model, tp_mesh, plan, sp: bool, last_stage: bool, pipelined: bool) -> bool:
    """TorchTitan's Llama recipe, with each Linear's style read off the plan's placements."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    from autopar.runtime.tensor_parallel.module_rules import tp_placement  # "RS(0)" over (dp, tp) -> "S(0)"

    def tp(name: str) -> str:
        return tp_placement(plan.param_placements.get(name, "RR"))

    for index, layer in model.layers.items():
        styles = {}
        for path, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear):
                placement = tp(f"layers.{index}.{path}.weight")
                if placement == "S(0)":
                    styles[path] = ColwiseParallel()
                elif placement == "S(1)":
                    styles[path] = RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())
        if sp:
            styles["attn_norm"] = SequenceParallel()
            styles["mlp_norm"] = SequenceParallel()
            styles["attn"] = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
            styles["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(layer, tp_mesh, styles)
    top = {}
    vocab_parallel = False
    if model.embed is not None and tp("embed.weight") == "S(0)":
        top["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())
    if model.final_norm is not None and sp:
        top["final_norm"] = SequenceParallel()
    if model.head is not None and tp("head.weight") == "S(0)":
        vocab_parallel = not pipelined
        top["head"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                      output_layouts=Shard(-1) if vocab_parallel else Replicate(),
                                      use_local_output=not vocab_parallel)
    if top:
        parallelize_module(model, tp_mesh, top)
    return vocab_parallel


# --- the measurement ---------------------------------------------------------------------------
def worker(rank: int, world: int, port: int, plan_json: str, steps: int, warmup: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from autopar.models import build_model
    from autopar.plan_schema import Plan

    plan = Plan.from_json(plan_json)
    s = plan.strategy
    spec = build_model(MODEL, CONFIG)
    generator = torch.Generator().manual_seed(SEED + 1)
    batch = torch.randint(0, spec.config.vocab, (GLOBAL_BATCH, spec.config.seq_len), generator=generator)
    parallel = autopar.parallelize(spec.module, plan, loss_fn=spec.loss_fn, seed=SEED)
    optimizer = torch.optim.SGD(parallel.parameters(), lr=LR, momentum=0.9)
    mesh = init_device_mesh("cpu", (s.pp, s.dp, s.tp), mesh_dim_names=("pp", "dp", "tp"))
    hand = hand_written(plan, spec, mesh, torch.device("cpu"))
    sides = {"autopar": lambda: parallel.train_step(batch, optimizer, max_grad_norm=0.0), "hand": lambda: hand(batch)}
    first = {name: run() for name, run in sides.items()}  # same plan, weights, batch: same first loss
    for _ in range(warmup - 1):
        for run in sides.values():
            run()
    times = {name: [] for name in sides}
    block = 2
    for _ in range(max(steps // block, 1)):
        for name, run in sides.items():
            for _ in range(block):
                dist.barrier()
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
    if rank == 0:
        torch.save({"first": first, "times": times}, out)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs; torch {torch.__version__}; "
          f"commit {commit}; gloo; model {MODEL} {CONFIG}, global batch {GLOBAL_BATCH}, fp32")
    print(f"{'mode':<7} {'world':>5} {'autopar ms':>10} {'hand ms':>8} {'ratio':>6}  first losses (autopar / hand)")
    for mode in args.modes.split(","):
        plan = plan_for(mode)
        s = plan.strategy
        world = s.dp * s.tp * s.pp
        with tempfile.TemporaryDirectory() as temporary:
            out = str(Path(temporary) / "result.pt")
            mp.start_processes(worker, args=(world, _free_port(), plan.to_json(), args.steps, args.warmup, out),
                               nprocs=world, start_method="spawn")
            result = torch.load(out, weights_only=False)
        ours, theirs = (statistics.median(result["times"][k]) for k in ("autopar", "hand"))
        first = result["first"]
        print(f"{mode:<7} {world:>5} {ours * 1e3:>10.1f} {theirs * 1e3:>8.1f} {ours / theirs:>6.2f}  "
              f"{first['autopar']:.5f} / {first['hand']:.5f}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
