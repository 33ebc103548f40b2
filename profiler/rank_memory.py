"""Peak tensor memory of one rank's training step through the runtime, from the allocator's own events.

Why: the memory model prices each rank's peak (`cost_models.evaluate.rank_memory`), and a plan the
searcher accepts must not run out of memory. `profiler.memory_tracker` checks one GPU's step under
torch's MemTracker, but MemTracker's dispatch mode breaks the runtime beyond one plain process: under
tensor parallelism DTensor's foreach ops saw its wrapped tensors as "mixed torch.Tensor and DTensor",
and pipelining's backward (`autograd.grad`) refused its hooks. The profiler's memory events come from
the allocator itself (`torch.profiler.profile(profile_memory=True)`), below every tensor subclass and
schedule, so any plan's step can be measured on CPU/gloo with real (small) tensors.

What is measured, per rank: the bytes held when the step starts (this rank's parameter shards and
optimizer states, counted by their storages: they were allocated before the profile) plus the largest
rise of the allocator's running total during a profiled `train_step`, after one unprofiled step
(Adam's moments exist; the step is the steady state), the least over a few steps (`step_peak_bytes`).
Tensor storage only: no allocator rounding, as `cost_models.memory.storage_bytes` prices it.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def held_bytes(parallel, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages of this rank's parameters, gradients and optimizer states."""
    storages: dict[int, int] = {}
    tensors = [p for module in parallel.modules for p in module.parameters()]
    tensors += [p.grad for p in tensors if p.grad is not None]
    tensors += [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _allocations(prof) -> list[tuple[int, int]]:
    """(time in ns, bytes: + allocated, - freed) of every CPU allocator event the profile recorded."""
    from torch._C._profiler import _EventType

    found: list[tuple[int, int]] = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
            found.append((node.start_time_ns, node.extra_fields.alloc_size))
        pending.extend(node.children)
    return sorted(found)


def step_peak_bytes(parallel, optimizer: torch.optim.Optimizer, batch: torch.Tensor,
                    max_grad_norm: float = 1.0, steps: int = 5) -> dict[str, int]:
    """This rank's peak over a `train_step` (after one unprofiled step): `held_bytes` at its start plus
    the allocator's largest rise during it, the least over `steps` profiled steps (`peak_bytes`) and the
    largest (`worst_peak_bytes`).

    Why both: under gloo the same step's peak varies by up to a few activation-sized buffers. An
    all_gather's output is referenced by the step and by gloo's work object; whichever thread drops the
    last reference frees it, so where the worker thread is late the buffer outlives the op that consumed
    it (seen in tp's forward: one `Redistribute` free moved past the next layer's allocations). The least
    peak is the step's own tensors, which the memory model prices; the spread is the race."""
    parallel.train_step(batch, optimizer, max_grad_norm=max_grad_norm)
    held = held_bytes(parallel, optimizer)
    rises = []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            parallel.train_step(batch, optimizer, max_grad_norm=max_grad_norm)
        running = rise = 0
        for _, size in _allocations(prof):
            running += size
            rise = max(rise, running)
        rises.append(rise)
    return {"peak_bytes": held + min(rises), "worst_peak_bytes": held + max(rises), "held_bytes": held,
            "rise_bytes": min(rises)}
