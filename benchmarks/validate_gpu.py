"""Cost model vs measurement on one GPU: GPT sizes × micro-batch × recompute, predicted and
measured step time and peak memory (`torch.cuda.max_memory_allocated`).

One call on the lent GPU:
    python benchmarks/validate_gpu.py [--configs gpt3-1.3b:1,gpt3-1.3b:2,gpt2-350m:4] [--steps 8]
Goals (issue #4): step time within 10%, memory within 5% and never under-predicted by more than 2%.
A CPU smoke run (`--device cpu --configs gpt:2 --model-config layers=2,hidden=64,heads=4,vocab=256,seq_len=64`)
only checks that the script works.

Training step as the runtime will run it on one GPU: fp32 master weights and AdamW states, bf16
autocast compute (16 bytes of model state per parameter, as the cost model's mixed precision),
fused attention, full recompute by checkpointing each block.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint

from autopar.cluster import load_cluster
from autopar.graph import trace
from autopar.models import build_model
from autopar.plan_schema import Strategy
from autopar.cost_models.evaluate import evaluate
from autopar.cost_models.facts import model_facts


def measure(name: str, overrides: str | None, batch: int, seq_len: int, recompute: bool, device: str,
            steps: int, precision: str) -> tuple[float, int]:
    spec = build_model(name, overrides, device=device, seed=0)
    model = spec.module
    if recompute:
        for layer in model.layers.values():
            forward = layer.forward
            layer.forward = lambda *args, _f=forward: checkpoint(_f, *args, use_reentrant=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    (ids,) = spec.example_inputs(batch, seq_len, device=device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    times = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.autocast(device_type=device, dtype=dtype, enabled=precision != "fp32"):
            loss = spec.loss_fn(model(ids), ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= 2:  # warm-up: allocator, kernels, optimizer states
            times.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return statistics.median(times), peak


def predict(name: str, overrides: str | None, batch: int, seq_len: int, recompute: bool, cluster,
            precision: str) -> tuple[float, float]:
    spec = build_model(name, overrides)
    graph = trace(spec.module, spec.example_inputs(1, seq_len), loss_fn=spec.loss_fn, precision=precision, name=name)
    facts = model_facts(graph, heads=spec.config.heads)
    strategy = Strategy(dp=1, tp=1, pp=1, microbatch=batch, num_microbatches=1,
                        recompute="full" if recompute else "none")
    result = evaluate(facts, cluster, strategy, batch)
    # max_memory_allocated excludes allocator fragmentation, so compare without the margin.
    return result.step_time_s, result.peak_memory_bytes - result.memory[0].margin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="gpt3-1.3b:1,gpt3-1.3b:4,gpt2-350m:8", help="model:microbatch,...")
    parser.add_argument("--model-config", default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="bf16")
    args = parser.parse_args()
    cluster = load_cluster("local")
    print(f"device: {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}; "
          f"cost model GPU: {cluster.gpu.name}; torch {torch.__version__}")
    print(f"{'model':<12} {'mb':>3} {'recompute':>9} {'measured s':>10} {'predicted s':>11} {'err':>7} "
          f"{'measured GiB':>12} {'predicted GiB':>13} {'err':>7}")
    for item in args.configs.split(","):
        name, _, mb = item.partition(":")
        batch = int(mb or 1)
        seq = args.seq_len or build_model(name, args.model_config).default_seq_len
        for recompute in (False, True):
            try:
                measured_s, measured_bytes = measure(name, args.model_config, batch, seq, recompute, args.device,
                                                     args.steps, args.precision)
            except torch.OutOfMemoryError:
                print(f"{name:<12} {batch:>3} {str(recompute):>9}  out of memory")
                torch.cuda.empty_cache()
                continue
            predicted_s, predicted_bytes = predict(name, args.model_config, batch, seq, recompute, cluster,
                                                   args.precision)
            memory_error = (predicted_bytes - measured_bytes) / measured_bytes if measured_bytes else float("nan")
            print(f"{name:<12} {batch:>3} {str(recompute):>9} {measured_s:>10.4f} {predicted_s:>11.4f} "
                  f"{(predicted_s - measured_s) / measured_s:>+7.1%} {measured_bytes / 2**30:>12.2f} "
                  f"{predicted_bytes / 2**30:>13.2f} {memory_error:>+7.1%}")


if __name__ == "__main__":
    main()
