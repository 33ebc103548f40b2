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

Gradient clipping hands its scale to the fused step (`defer_gradient_scale`): torch's fused AdamW
divides each gradient by `grad_scale` inside its own kernel (the hook torch.amp.GradScaler uses), so
the clip's separate scaling pass over every gradient (read and write, 8 bytes per parameter) is
gone. On an H200 that pass and the norm took 10.6 ms of a 269 ms GPT-1.3B step; under offload, on the
host, 1.16 s of a 2.99 s GPT-2.7B step (benchmarks/gpu_diagnose.py at af063d4).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication


def optimizer_implementation(params: list[torch.Tensor], offload: str = "none") -> str:
    """'fused' when every shard is on a CUDA device, or on the host under optimizer offload; else 'foreach'."""
    devices = {(p.to_local() if isinstance(p, DTensor) else p).device.type for p in params}
    if devices == {"cuda"} or (offload == "optimizer" and devices == {"cpu"}):
        return "fused"
    return "foreach"


def build_optimizer(params: list[torch.Tensor], lr: float, offload: str = "none", **options) -> torch.optim.AdamW:
    """AdamW over `params` (a ParallelModel's parameters) in the implementation above. Over tp shards
    beside plain tensors, step it in `step_context` (`ParallelModel.train_step` does)."""
    fused = optimizer_implementation(params, offload) == "fused"
    return torch.optim.AdamW(params, lr=lr, fused=fused, foreach=None if fused else True, **options)


def mixed_placements(params: list[torch.Tensor]) -> bool:
    """Whether `params` mix DTensor shards with plain tensors: tensor parallelism without sequence
    parallelism keeps the norms' weights (and any weight it leaves replicated) plain beside its
    sharded Linears, under the module rules and through DTensor alike."""
    kinds = {isinstance(p, DTensor) for p in params}
    return len(kinds) > 1


def step_context(params: list[torch.Tensor]):
    """What an optimizer step over `params` runs in: `implicit_replication` where they mix DTensor
    shards and plain tensors, else nothing.

    torch's foreach and fused AdamW step one list per device and dtype, and DTensor refuses a list
    that mixes the two kinds ("got mixed torch.Tensor and DTensor"): the runtime's optimizer failed at
    the first step of every tp plan without sp. Under implicit replication the plain tensors count as
    replicated on the shards' mesh; the step is elementwise and sends nothing, so each rank updates
    what it holds. The optimizer stays torch's own AdamW, so a checkpoint names the same class under
    every plan (a dp checkpoint resumes under tp). Not reentrant: leaving it turns it off."""
    return implicit_replication() if mixed_placements(params) else contextlib.nullcontext()


def defer_gradient_scale(optimizer: torch.optim.Optimizer | None, scale: torch.Tensor, devices: set) -> bool:
    """Have `optimizer`'s next step multiply the gradients by `scale` (a 0-dim tensor), where it is
    torch's fused AdamW over gradients on one device; False where the caller must scale them itself.
    The step also leaves the gradients scaled, as a clip would. The scale is the next step's only: a
    post-step hook forgets it (`clear_gradient_scale`), so a later step without clipping cannot reuse it."""
    if optimizer is None or not optimizer.defaults.get("fused") or len(devices) != 1:
        return False
    (device,) = devices
    if not getattr(optimizer, "_autopar_clears_scale", False):  # a user's own `optimizer.step()` clears it too
        optimizer.register_step_post_hook(lambda stepped, _args, _kwargs: clear_gradient_scale(stepped))
        optimizer._autopar_clears_scale = True
    optimizer.grad_scale = (1.0 / scale).to(device=device, dtype=torch.float32)  # a host copy under offload
    optimizer.found_inf = None
    return True


def hand_found_inf(optimizer: torch.optim.Optimizer | None, found_inf: torch.Tensor) -> bool:
    """Give `optimizer`'s next step the overflow flag (fp16), where it took a deferred scale and is torch's
    fused Adam or AdamW: a flag of 1 then leaves every parameter, moment and its step count as they are.
    False where the caller must decide on the host whether to step: other fused optimizers take the flag
    too, but fused SGD makes its momentum buffers uninitialized on its first step and, skipped, would
    read them on the next (found by a review)."""
    scale = getattr(optimizer, "grad_scale", None)
    if scale is None or not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return False
    optimizer.found_inf = found_inf.to(scale.device)  # a host copy under offload, as the scale's
    return True


def clear_gradient_scale(optimizer: torch.optim.Optimizer) -> None:
    """Forget a deferred scale and overflow flag once the step has used them (a later step without
    clipping must not reuse them)."""
    if getattr(optimizer, "grad_scale", None) is not None:
        optimizer.grad_scale = None
    if getattr(optimizer, "found_inf", None) is not None:
        optimizer.found_inf = None
