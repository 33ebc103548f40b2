"""What this machine's host does for optimizer-state offload, measured: the host step the runtime
runs there (gradient clipping, then the fused CPU AdamW), and the PCIe copies between a GPU and
pinned host memory.

A preset's host is a DGX's (`cluster._DGX_HOSTS`), which the machine autopar runs on need not be:
on the lent H100 (a 16-core VM) an offloaded GPT-2.7B step took 2.67 s where the DGX host prices
0.94 s (benchmarks/gpu_runs/h100-2026-11-26-2fef514.json). `--cluster local` measures both rates
(about a second) so that offload is priced on the host that runs it.
"""

from __future__ import annotations

import time

import torch

from autopar.gradient_norm import squares_sum

HOST_OPTIMIZER_PARAMS = 2**25  # 128 MiB per fp32 tensor: far past any CPU cache
PCIE_BYTES = 2**28
REPEATS = 3


def host_optimizer_params_per_s(params: int = HOST_OPTIMIZER_PARAMS, repeats: int = REPEATS) -> float:
    """Parameters per second this host (all its threads) steps offloaded shards at, as the runtime
    does (`ParallelModel.train_step`): the gradients' norm (`clip_grad_norm_`, on the host under
    offload: `autopar.gradient_norm`), then torch's fused CPU AdamW scaling them in its own pass
    (`runtime.optimizer`). The best of `repeats` steps over eight tensors."""
    shards = [torch.nn.Parameter(torch.randn(params // 8)) for _ in range(8)]
    for shard in shards:
        shard.grad = torch.randn_like(shard)
    optimizer = torch.optim.AdamW(shards, lr=1e-4, fused=True)
    optimizer.step()  # the moments
    return params / _best_s(lambda: host_step(shards, optimizer), repeats)


def host_step(shards: list[torch.Tensor], optimizer: torch.optim.Optimizer, max_norm: float = 1.0) -> None:
    """Clip the shards' gradients to `max_norm` as the runtime does under offload: one norm pass, and
    the scale applied inside the fused step (the runtime's `runtime.optimizer.defer_gradient_scale`;
    not imported here, below the runtime)."""
    norm = squares_sum([shard.grad for shard in shards]).sqrt()
    optimizer.grad_scale = 1.0 / (max_norm / (norm + 1e-6)).clamp(max=1.0)
    optimizer.step()
    optimizer.grad_scale = None


def pcie_bytes_per_s(device: torch.device, size: int = PCIE_BYTES, repeats: int = REPEATS) -> float:
    """One direction's bytes per second between `device` and pinned host memory: the slower of
    host→device and device→host, as FSDP2's CPU offload copies (pinned, non-blocking)."""
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(size, dtype=torch.uint8, device=device)

    def copy(target, source):
        def run():
            target.copy_(source, non_blocking=True)
            torch.cuda.synchronize(device)
        return run

    run = copy(gpu, host)
    run()
    to_device = size / _best_s(run, repeats)
    to_host = size / _best_s(copy(host, gpu), repeats)
    return min(to_device, to_host)


def _best_s(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best
