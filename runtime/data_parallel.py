"""Data parallelism and ZeRO over the dp axis.

- zero 0: replicated parameters; gradients all-reduced (averaged) over dp in buckets launched during
  the last micro-batch's backward as each bucket's gradients become final (as DDP overlaps them),
  the last bucket exposed: what the evaluator prices (`overlap_grad_sync=True`).
- zero 1 and 2: FSDP2 without resharding after forward: parameters are gathered once per step and
  kept through backward, gradients reduce-scattered, optimizer states sharded. Zero 1 reduces once
  after the last micro-batch; zero 2 reduce-scatters every micro-batch so only shards of the
  gradients persist.
- zero 3: FSDP2 resharding after forward (parameters gathered again for backward).
- offload=optimizer (any zero ≥ 1): FSDP2's CPUOffloadPolicy keeps the sharded fp32 parameters,
  their reduced gradients and so the optimizer states in host memory, and the optimizer steps them
  on the CPU; shards are copied to the device before each all-gather and gradients back after each
  reduce-scatter (`cost_models.offload` prices those copies). On a CPU/gloo run it changes no
  placement; the data path (and the collectives) are the same FSDP2 code's.
Under pipeline stages (`runtime.pipeline.zero_stage`) the schedule drives FSDP2 per micro-batch:
zero 1 and 2 keep the weights gathered from each unit's first forward to the step's end; zero 1
reduce-scatters once after the last micro-batch, zero 2 every micro-batch; zero 3 frees the weights
after every forward and backward and reduce-scatters the gradients, accumulated whole, once per
step (as TorchTitan composes FSDP2 with its pipeline stages, and Llama 3 trained).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

BUCKET_BYTES = 25 * 2**20


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, zero: int, block_paths: list[str],
               mixed_precision: MixedPrecisionPolicy | None, offload: str = "none") -> None:
    """FSDP2 per block (one gather/scatter unit each), then the rest of the module as the root unit.
    `offload="optimizer"`: sharded states on the CPU (pinned when the mesh is on CUDA, for copies
    that overlap compute); the caller materializes the parameters on the CPU (`parameter_device`)."""
    options = {"mesh": dp_mesh, "reshard_after_forward": zero >= 3}
    if mixed_precision is not None:
        options["mp_policy"] = mixed_precision
    if offload == "optimizer":
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda")
    for path in block_paths:
        fully_shard(model.get_submodule(path), **options)
    fully_shard(model, **options)


def parameter_device(device: torch.device, offload: str) -> torch.device:
    """Where this rank's parameter shards live: the host under offload=optimizer, else the device."""
    return torch.device("cpu") if offload == "optimizer" else device


def set_microbatch_boundary(modules: list[nn.Module], zero: int, last: bool) -> None:
    """Before a micro-batch's backward: what FSDP does at its end.

    ZeRO 1 reduce-scatters gradients only after the last micro-batch (ZeRO 2/3 every one, which is
    what keeps their gradients sharded); ZeRO 1/2 keep the gathered weights until the last
    micro-batch (one all-gather per step, as torch's pipeline schedules also do, and as their
    memory model holds the full weights); ZeRO 3 frees them after every backward.
    """
    for module in modules:
        if isinstance(module, FSDPModule):
            if zero < 2:
                module.set_requires_gradient_sync(last)
            if zero < 3:
                module.set_reshard_after_backward(last)


def pipeline_microbatch_flags(zero: int) -> tuple[bool, bool]:
    """(requires_gradient_sync, reshard_after_backward) for each micro-batch's backward under a
    pipeline schedule, whose stage reduces what is left and reshards after the last one."""
    return zero == 2, zero >= 3


class GradientBuckets:
    """Zero 0's gradient sync, overlapped with backward.

    The gradients (this rank's local shards, reverse registration order: backward produces the last
    layers' first) are laid out in one fp32 buffer cut into ceil(bytes / BUCKET_BYTES) chunks of
    equal size, the calls and bytes the ledger predicts. A parameter's gradient is final after its
    `accumulations`-th accumulation in a step (one per micro-batch); it is copied into the buffer
    then, and a chunk whose parameters are all final is all-reduced asynchronously. `finish` sends
    any chunk still pending (parameters that got no gradient), waits, and writes the averages back.
    `divide_by` is the dp size, times the micro-batch count when the sum over micro-batches is still
    to be averaged (a pipeline schedule told not to scale its gradients, since they leave for the
    buffer before it would).
    """

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, accumulations: int,
                 divide_by: int) -> None:
        self.group, self.divide_by, self.accumulations = group, divide_by, accumulations
        self.params = [p for p in reversed(params) if p.requires_grad]
        offsets, total = [], 0
        for param in self.params:
            offsets.append(total)
            total += _local(param).numel()
        self.offsets, self.total = offsets, total
        self.buffer = torch.zeros(total, dtype=torch.float32, device=_local(self.params[0]).device) if total else None
        chunks = max(1, math.ceil(total * GRADIENT_BYTES / BUCKET_BYTES))
        self.bounds = [(total * i // chunks, total * (i + 1) // chunks) for i in range(chunks)]
        self.members = [[i for i, start in enumerate(offsets) if start < hi and start + _local(self.params[i]).numel() > lo]
                        for lo, hi in self.bounds]
        self.chunks_of = [[c for c, members in enumerate(self.members) if i in members] for i in range(len(self.params))]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self._reset()
        for param in self.params:
            param.register_post_accumulate_grad_hook(self._accumulated)

    def _reset(self) -> None:
        self.count = [0] * len(self.params)
        self.pending = [len(members) for members in self.members]
        self.handles: dict[int, object] = {}
        if self.buffer is not None:
            self.buffer.zero_()

    def _accumulated(self, param: nn.Parameter) -> None:
        i = self.index[id(param)]
        self.count[i] += 1
        if self.count[i] != self.accumulations:
            return
        grad = _matching(param)
        start = self.offsets[i]
        self.buffer[start:start + grad.numel()].copy_(grad.reshape(-1))
        for chunk in self.chunks_of[i]:
            self.pending[chunk] -= 1
            if self.pending[chunk] == 0:
                self._launch(chunk)

    def _launch(self, chunk: int) -> None:
        lo, hi = self.bounds[chunk]
        self.handles[chunk] = dist.all_reduce(self.buffer[lo:hi], group=self.group, async_op=True)

    def finish(self) -> None:
        """After the last backward: every chunk sent and averaged, gradients written back."""
        if self.buffer is None:
            return
        for i, param in enumerate(self.params):  # final gradients whose hook never completed (unused)
            if self.count[i] and self.count[i] != self.accumulations:
                self.count[i] = self.accumulations - 1
                self._accumulated(param)
        for chunk in range(len(self.bounds)):
            if chunk not in self.handles:
                self._launch(chunk)
        for chunk in range(len(self.bounds)):
            self.handles[chunk].wait()
        self.buffer.div_(self.divide_by)
        for param, start in zip(self.params, self.offsets):
            if param.grad is not None:
                local = _local(param.grad)
                local.copy_(self.buffer[start:start + local.numel()].view_as(local))
        self._reset()


GRADIENT_BYTES = 4  # reduced in fp32, as the ledger's GRADIENT_REDUCE_BYTES


def _matching(param: nn.Parameter) -> torch.Tensor:
    """The local gradient laid out as the parameter's local shard. A vocabulary-parallel embedding's
    gradient comes back replicated: slicing it to the weight's shard costs no communication."""
    grad = param.grad
    if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements \
            and not any(p.is_partial() for p in grad.placements):
        param.grad = grad = grad.redistribute(param.device_mesh, param.placements)
    return _local(grad)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
