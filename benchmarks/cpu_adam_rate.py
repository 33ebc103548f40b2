"""The CPU optimizer step's share of host memory bandwidth, measured on this machine.

`offload=optimizer` prices the CPU Adam step as bytes moved (28 per parameter: read the fp32
weight, gradient and two moments, write weight and moments) over the node's host memory bandwidth
times `cost_models.offload.CPU_ADAM_EFFICIENCY`. No published figure gives that fraction for
torch's Adam, so this measures it: torch's AdamW step on CPU (`--implementation fused`, what the
runtime steps offloaded shards with, `runtime.optimizer`; or `foreach`, torch's default) against a
plain copy (2 bytes moved per byte copied, STREAM's copy) on the same threads and sizes. It also
times the clipping's norm over the same gradients, as torch's foreach norm runs it on the host (one
thread per tensor) and as the runtime does (`autopar.gradient_norm`, by rows over the threads).

    python benchmarks/cpu_adam_rate.py [--params 20000000] [--threads 1] [--implementation fused]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from autopar.gradient_norm import squares_sum

ADAM_BYTES_PER_PARAM = 28


def best_of(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=20_000_000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--implementation", choices=("fused", "foreach"), default="fused")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, {args.threads} thread(s), "
          f"torch {torch.__version__}, AdamW {args.implementation}")
    # a few tensors, as FSDP2's flat shards per unit
    params = [torch.nn.Parameter(torch.randn(args.params // 8)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    fused = args.implementation == "fused"
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=fused, foreach=None if fused else True)
    optimizer.step()  # allocate the moments
    adam_s = best_of(args.repeats, optimizer.step)
    source = torch.randn(args.params)
    target = torch.empty_like(source)
    copy_s = best_of(args.repeats, lambda: target.copy_(source))
    adam_bytes_per_s = args.params * ADAM_BYTES_PER_PARAM / adam_s
    copy_bytes_per_s = args.params * 4 * 2 / copy_s
    print(f"Adam step: {args.params / adam_s / 1e6:.1f} M params/s = {adam_bytes_per_s / 1e9:.2f} GB/s moved")
    print(f"copy:      {copy_bytes_per_s / 1e9:.2f} GB/s moved")
    print(f"Adam / copy = {adam_bytes_per_s / copy_bytes_per_s:.2f}")
    grads = [p.grad for p in params]
    foreach_s = best_of(args.repeats, lambda: torch._foreach_norm(grads, 2.0))
    rows_s = best_of(args.repeats, lambda: squares_sum(grads))
    print(f"gradient norm: foreach {args.params * 4 / foreach_s / 1e9:.2f} GB/s read, "
          f"by rows (the runtime's) {args.params * 4 / rows_s / 1e9:.2f} GB/s read")


if __name__ == "__main__":
    main()
