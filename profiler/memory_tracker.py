"""True peak memory of one single-GPU training step, measured by torch's own tracker under fake tensors.

Why: the analytic memory model (`cost_models.memory`, priced by `cost_models.evaluate.evaluate`)
counts model states per parameter and the traced graph's saved activations. What the runtime really
holds at its peak also includes autocast's bf16 weight copies, the fp32 logits and the loss's
buffers, backward's transient gradients and the optimizer's temporaries (issue #29). This module
runs what `runtime.parallelize.ParallelModel.train_step` runs on one GPU (dp = tp = pp = 1, zero 0)
and reports what `torch.distributed._tools.mem_tracker.MemTracker` saw, so the model can be checked
shape by shape without a GPU.

What runs: the zoo model, materialized as fake CPU tensors (nothing is computed, every allocation
is counted; built under the mode on the CPU device), its `layers.N` blocks checkpointed by `runtime.recompute.apply_recompute` as the plan's
`recompute_modules` name them; per micro-batch, under `torch.autocast("cpu", bf16)` for bf16 over
fp32 parameters, `loss = loss_fn(module(x), x)` and `(loss / num_microbatches).backward()`; then
the foreach gradient norm and clip, `AdamW(lr=1e-4, fused=True)` (or foreach) `.step()` and
`zero_grad(set_to_none=True)`. Two steps: the first allocates Adam's moments lazily; the second is
the steady state. Peaks are in bytes of tensor storage (no allocator rounding or fragmentation).

Differences from CUDA: CPU autocast (not CUDA's: its op lists differ, e.g. CUDA upcasts layer_norm
to fp32; here every norm input is the fp32 residual, so both give fp32), and the CPU attention
kernel (`_scaled_dot_product_flash_attention_for_cpu`, which like CUDA's flash kernel saves a
logsumexp, not the s x s scores, but its workspace differs). Fake CUDA tensors were not autocast on
this torch build, hence the CPU device.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from autopar.errors import AutoparError
from autopar.models import build_model
from autopar.runtime.recompute import apply_recompute

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def recompute_paths(module: nn.Module) -> list[str]:
    """The zoo's repeated blocks, `layers.N`: what the searcher's plan lists in `recompute_modules`
    when every layer recomputes (`cost_models.recompute.recomputed_units`)."""
    return [f"layers.{name}" for name in module.layers]


def _snapshot(tracker: MemTracker, kind: str) -> dict[str, int]:
    """One device's snapshot by category (Parameter, Buffer, Gradient, Activation, Temp, Optstate, Total)."""
    snaps = tracker.get_tracker_snapshot(kind)
    if len(snaps) != 1:
        raise AutoparError(f"expected one device in the tracker's {kind} snapshot, got {list(snaps)}")
    (snap,) = snaps.values()
    return {getattr(key, "value", str(key)): int(value) for key, value in snap.items()}


def _clip_grad_norm(params: list[nn.Parameter], max_norm: float = 1.0) -> torch.Tensor:
    """`ParallelModel.clip_grad_norm_` on one rank: foreach norms, one scale, foreach multiply."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = torch._foreach_norm(grads, 2.0)
    norm = torch.stack(norms).float().pow(2).sum().sqrt()
    torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


def tracked_step_memory(model: str, model_config: str | None, seq_len: int, microbatch: int,
                        num_microbatches: int, precision: str, recompute: str,
                        optimizer_impl: str = "fused") -> dict:
    """Peak bytes of two training steps of `model` (a zoo name; `model_config` its overrides, as
    `--model-config` takes them) on one device, in the runtime's order. Returns ints: `peak_bytes`
    (the second step), `first_step_peak_bytes`, `by_category` (the second step's snapshot at its
    peak), `first_step_by_category`, `after_step_bytes` (what stays between steps: parameters,
    optimizer states), `params`, and `dtype_check`, the dtype of a linear's output in the forward
    (bf16 under bf16: the check that autocast took effect)."""
    if precision not in _DTYPES:
        raise AutoparError(f"precision {precision!r}: use fp32 or bf16")
    if optimizer_impl not in ("fused", "foreach"):
        raise AutoparError(f"optimizer_impl {optimizer_impl!r}: use fused or foreach")
    autocast = precision == "bf16"
    seen: list[torch.dtype] = []
    with FakeTensorMode():
        spec = build_model(model, model_config, device="cpu")  # fake CPU tensors: shapes only
        module = spec.module
        apply_recompute(module, recompute_paths(module), recompute)
        probe = next(m for name, m in module.named_modules() if isinstance(m, nn.Linear) and name.startswith("layers."))
        probe.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
        params = list(module.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=optimizer_impl == "fused",
                                      foreach=None if optimizer_impl == "fused" else True)
        batch = torch.randint(0, spec.config.vocab, (microbatch * num_microbatches, seq_len))
        tracker = MemTracker()
        tracker.track_external(module, optimizer, batch)
        peaks: list[tuple[int, dict[str, int]]] = []
        for _step in range(2):
            with tracker:  # entering resets the peak to what is held now
                for x in batch.chunk(num_microbatches):
                    tracker.reset_mod_stats()  # the tracker refuses a root module's second forward otherwise
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        loss = spec.loss_fn(module(x), x)
                    (loss / num_microbatches).backward()
                    del loss
                _clip_grad_norm(params)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            snap = _snapshot(tracker, "peak")
            peaks.append((snap["Total"], snap))
        after = _snapshot(tracker, "current")["Total"]
    expected = _DTYPES[precision]
    if not seen or any(dtype != expected for dtype in seen):
        raise AutoparError(f"a linear's output was {sorted(set(map(str, seen)))} under {precision}, not {expected}")
    return {
        "peak_bytes": peaks[1][0], "first_step_peak_bytes": peaks[0][0],
        "by_category": {k: v for k, v in peaks[1][1].items() if k != "Total"},
        "first_step_by_category": {k: v for k, v in peaks[0][1].items() if k != "Total"},
        "after_step_bytes": after, "params": sum(p.numel() for p in params),
        "dtype_check": {torch.bfloat16: "bf16", torch.float32: "fp32"}[expected],
    }
