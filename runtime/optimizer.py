"""The optimizer the runtime steps: AdamW, in the fastest of torch's implementations that runs where
this rank's parameter shards live.

- `fused`: one kernel per parameter group and device instead of a dozen per tensor list. On CUDA it
  is what the fastest hand-written baselines use (GPT-1.3B on an H100: 423.4 ms per step with the
  foreach default, 396.8 ms fused; ../shared/gpu/h100-2026-11-26.json), and it takes DTensor shards
  (FSDP2, tp). Under `offload=optimizer` the shards live on the host and torch's fused CPU AdamW
  steps them (on this 2-core VM 11x the foreach step's rate: benchmarks/cpu_adam_rate.py).
- `foreach`: torch's default, kept for parameters on the CPU of a CPU run (the gloo tests), whose
  parity references use it.
The choice is reported (`autopar run`'s optimizations line) and priced (`cost_models.optimizer`).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def optimizer_implementation(params: list[torch.Tensor], offload: str = "none") -> str:
    """'fused' when every shard is on a CUDA device, or on the host under optimizer offload; else 'foreach'."""
    devices = {(p.to_local() if isinstance(p, DTensor) else p).device.type for p in params}
    if devices == {"cuda"} or (offload == "optimizer" and devices == {"cpu"}):
        return "fused"
    return "foreach"


def build_optimizer(params: list[torch.Tensor], lr: float, offload: str = "none", **options) -> torch.optim.AdamW:
    """AdamW over `params` (a ParallelModel's parameters) in the implementation above."""
    fused = optimizer_implementation(params, offload) == "fused"
    return torch.optim.AdamW(params, lr=lr, fused=fused, foreach=None if fused else True, **options)
