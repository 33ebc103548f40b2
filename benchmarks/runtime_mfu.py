"""Throughput on one GPU: plain PyTorch (eager, compiled) against the autopar runtime (eager, compiled).

Issue #6 item 6. One device call from the repo root:
    python benchmarks/runtime_mfu.py --out $OUT/runtime_mfu.json
Defaults: gpt3-1.3b, bf16 autocast over fp32 master weights, seq 2048, micro-batch 4, 5 warm-up and 20
timed steps per variant. Time estimate (not measured: the cost model predicts 0.14 s per step on an
H100 for the plan it picks, and compile times are guesses): 100 steps take under a minute in all,
compiling the whole model (b) and the blocks (d) one to three minutes each, tracing and searching
the plan about 15 s (measured on CPU): about 5 minutes, under 8 with model set-up.

Variants, each with its own model and optimizer (memory freed and an out-of-memory caught per variant):
  (a) eager:           the zoo model as a plain module, AdamW, gradient clipping at 1.0
  (b) compiled:        (a) under torch.compile of the whole model
  (c) autopar:         `parallelize` with the plan `autopar run --cluster local` searches for one device
  (d) autopar+compile: (c) with per-block torch.compile (`autopar run --compile`)
MFU = 6 x parameters x tokens/s over the preset's dense peak of the precision (the denominator
`autopar run` uses), and over a measured large-matmul ceiling (what this device really reaches).
Goal (issue #6): (d) over (b) >= 1.0, printed as `ratio c_over_b`. A CPU smoke run (`--device cpu
--precision fp32 --no-compile` and a tiny `--model-config`) only checks that the script works.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import time
from pathlib import Path

import torch

from autopar.models import build_model

MAX_GRAD_NORM = 1.0
LR = 1e-4
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    """Between variants: nothing of one variant may count against the next one's memory."""
    gc.collect()
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def matmul_ceiling_flops_per_s(device: str, precision: str, size: int, repeats: int = 20) -> float:
    """What one large matmul reaches here: the practical ceiling of a training step's FLOP/s."""
    dtype = DTYPES[precision] if device == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    elapsed_s = time.perf_counter() - started
    del a, b
    return 2 * size**3 * repeats / elapsed_s


def timed_steps(step, device: str, warmup: int, steps: int) -> dict:
    """Warm-up (compilation, allocator, optimizer states), then `steps` steps timed as one interval."""
    losses = [step() for _ in range(warmup)]
    sync(device)
    started = time.perf_counter()
    losses += [step() for _ in range(steps)]
    sync(device)
    elapsed_s = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return {"step_s": elapsed_s / steps, "peak_memory_bytes": peak, "first_loss": losses[0], "last_loss": losses[-1]}


def token_batch(spec, args) -> torch.Tensor:
    """The same random tokens for every variant (the global generator's state differs between them)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.config.vocab, (args.micro_batch, args.seq_len), generator=generator)
    return ids.to(args.device)


def plain_variant(args, compiled: bool) -> dict:
    """(a)/(b): the model as a plain module on the device, nothing of autopar's runtime."""
    from autopar.runtime.init import InitSource, materialize

    spec = build_model(args.model, args.model_config)
    model = copy.deepcopy(spec.module)  # the runtime's initial weights, so every variant's first loss agrees
    materialize(model, InitSource(spec.module, 0), torch.device(args.device))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR)  # what `autopar run` uses
    forward = torch.compile(model) if compiled else model
    ids = token_batch(spec, args)
    dtype = DTYPES[args.precision]

    def step() -> float:
        with torch.autocast(device_type=args.device, dtype=dtype, enabled=args.precision != "fp32"):
            loss = spec.loss_fn(forward(ids), ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return timed_steps(step, args.device, args.warmup, args.steps)


def search_plan(args):
    """The plan `autopar run --cluster CLUSTER --global-batch MICRO_BATCH` chooses for one device."""
    import autopar

    spec = build_model(args.model, args.model_config)
    cluster = autopar.load_cluster(args.cluster, gpus=1)
    result = autopar.plan(spec.module, spec.example_inputs(1, args.seq_len), cluster=cluster,
                          global_batch=args.micro_batch, loss_fn=spec.loss_fn, precision=args.precision,
                          name=spec.name, seq_len=args.seq_len)
    if result.plan is None:
        raise SystemExit(f"runtime_mfu: {result.no_fit_reason()}")
    return result.plan, cluster


def runtime_variant(args, plan, compiled: bool) -> dict:
    """(c)/(d): `autopar run`'s step (ParallelModel.train_step) on the searched plan."""
    import torch.distributed as dist

    from autopar.runtime.parallelize import parallelize

    spec = build_model(args.model, args.model_config)
    had_group = dist.is_initialized()
    try:
        parallel = parallelize(spec.module, plan, loss_fn=spec.loss_fn, seed=0, precision=args.precision,
                               compile=compiled)
        if parallel.layout.device.type != args.device:
            raise RuntimeError(f"the runtime placed the model on {parallel.layout.device}, not {args.device}")
        optimizer = torch.optim.AdamW(parallel.parameters(), lr=LR)
        ids = token_batch(spec, args)
        return timed_steps(lambda: parallel.train_step(ids, optimizer, max_grad_norm=MAX_GRAD_NORM), args.device,
                           args.warmup, args.steps)
    finally:
        if not had_group and dist.is_initialized():
            dist.destroy_process_group()


def run_variant(name: str, measure) -> dict:
    """One variant; an out-of-memory or a failure is this variant's row, not the end of the run."""
    try:
        return {"variant": name, "status": "ok", **measure()}
    except torch.OutOfMemoryError:
        return {"variant": name, "status": "out of memory"}
    except Exception as error:  # a compile failure on one variant must not hide the others' figures
        first_line = (str(error).strip().splitlines() or [""])[0][:300]
        return {"variant": name, "status": f"error: {type(error).__name__}: {first_line}"}


def write(path: str | None, record: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(record, indent=2) + "\n")


def ratio(rows: dict, top: str, bottom: str) -> float | None:
    if rows.get(top, {}).get("status") == "ok" and rows.get(bottom, {}).get("status") == "ok":
        return rows[top]["tokens_per_s"] / rows[bottom]["tokens_per_s"]
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", default="gpt3-1.3b")
    parser.add_argument("--model-config", default=None, metavar="K=V,...")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per step (the plan's global batch)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    # fp16 would need loss scaling, which the runtime refuses (`runtime.precision`)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--cluster", default="local", help="cluster to plan for and take the peak from")
    parser.add_argument("--matmul-size", type=int, default=8192, help="side of the square matmul ceiling")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled variants (b) and (d)")
    parser.add_argument("--out", metavar="result.json", help="write the table and settings as JSON here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available: use --device cpu for a smoke run")
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    tokens_per_step = args.micro_batch * args.seq_len
    num_params = sum(p.numel() for p in build_model(args.model, args.model_config).module.parameters())
    plan, cluster = search_plan(args)
    peak = cluster.gpu.peak_flops_per_s(args.precision)
    ceiling = matmul_ceiling_flops_per_s(args.device, args.precision, args.matmul_size)
    free_memory(args.device)
    s = plan.strategy
    plan_text = (f"dp={s.dp} tp={s.tp} pp={s.pp} zero={s.zero} microbatch={s.microbatch} x {s.num_microbatches} "
                 f"recompute={s.recompute}")
    print(f"device {device_name} (preset {cluster.gpu.name}, peak {peak / 1e12:.0f} TFLOP/s {args.precision}, "
          f"matmul {args.matmul_size}^3 {ceiling / 1e12:.1f} TFLOP/s); torch {torch.__version__}", flush=True)
    print(f"model {args.model} ({num_params:,} parameters), {args.precision}, micro-batch {args.micro_batch} x seq "
          f"{args.seq_len}; plan for one device: {plan_text}", flush=True)

    variants = [("eager", lambda: plain_variant(args, False)), ("compiled", lambda: plain_variant(args, True)),
                ("autopar", lambda: runtime_variant(args, plan, False)),
                ("autopar+compile", lambda: runtime_variant(args, plan, True))]
    if args.no_compile:
        variants = [v for v in variants if "compile" not in v[0]]
    rows: dict[str, dict] = {}
    record = {"device": device_name, "torch": torch.__version__, "model": args.model,
              "model_config": args.model_config, "num_params": num_params, "precision": args.precision,
              "seq_len": args.seq_len, "micro_batch": args.micro_batch, "warmup": args.warmup, "steps": args.steps,
              "cluster_gpu": cluster.gpu.name, "peak_flops_per_s": peak, "matmul_size": args.matmul_size,
              "matmul_ceiling_flops_per_s": ceiling, "plan": plan_text, "rows": [], "ratios": {}}
    print(f"{'variant':<16} {'step ms':>8} {'tokens/s':>10} {'MFU':>6} {'MFU/mm':>7} {'peak GiB':>8}  status",
          flush=True)
    for name, measure in variants:
        started = time.perf_counter()
        row = run_variant(name, measure)
        row["wall_s"] = time.perf_counter() - started
        free_memory(args.device)
        if row["status"] == "ok":
            row["tokens_per_s"] = tokens_per_step / row["step_s"]
            row["mfu"] = 6 * num_params * row["tokens_per_s"] / peak
            row["mfu_vs_matmul"] = 6 * num_params * row["tokens_per_s"] / ceiling
            print(f"{name:<16} {row['step_s'] * 1e3:>8.1f} {row['tokens_per_s']:>10,.0f} {row['mfu']:>6.1%} "
                  f"{row['mfu_vs_matmul']:>7.1%} {row['peak_memory_bytes'] / 2**30:>8.2f}  ok "
                  f"(loss {row['first_loss']:.3f} -> {row['last_loss']:.3f}, {row['wall_s']:.0f} s)", flush=True)
        else:
            print(f"{name:<16} {'':>8} {'':>10} {'':>6} {'':>7} {'':>8}  {row['status']}", flush=True)
        rows[name] = row
        record["rows"] = list(rows.values())
        write(args.out, record)  # after each variant: a run cut short still leaves what it measured

    ratios = {"c_over_b": ratio(rows, "autopar+compile", "compiled"),
              "autopar_over_compiled": ratio(rows, "autopar", "compiled"),
              "autopar_over_eager": ratio(rows, "autopar", "eager")}
    for key, value in ratios.items():
        print(f"ratio {key}: {'n/a' if value is None else f'{value:.3f}'}")
    record["ratios"] = ratios
    write(args.out, record)
    return 0 if all(row["status"] == "ok" for row in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
