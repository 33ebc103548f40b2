"""Count the collectives a training step executes, by mesh axis, kind and bytes.

"What runs is what was costed": the cost model's communication ledger
(`cost_models.collectives.step_collectives`) lists what a plan should send; this counter records
what the runtime does send, at the dispatcher, so every path is seen (c10d calls from FSDP2 and
our own gradient sync, functional collectives from DTensor, pipeline send/recv).

Bytes follow the cost model's convention: an all-reduce moves its buffer, an all-gather its
gathered output, a reduce-scatter its full input, a send or receive its tensor.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# c10d op name -> (kind, how its bytes are read from the arguments)
_C10D = {
    "allreduce_": ("all_reduce", "first"),
    "allreduce_coalesced_": ("all_reduce", "first"),
    "_allgather_base_": ("all_gather", "first"),
    "allgather_": ("all_gather", "first"),
    "allgather_into_tensor_coalesced_": ("all_gather", "first"),
    "_reduce_scatter_base_": ("reduce_scatter", "second"),
    "reduce_scatter_": ("reduce_scatter", "second"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "second"),
    "alltoall_base_": ("all_to_all", "second"),
    "broadcast_": ("broadcast", "first"),
    "send": ("send", "first"),
    "recv_": ("recv", "first"),
}
_FUNCTIONAL = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all", "broadcast": "broadcast",
}


@dataclass
class CollectiveCounts:
    """Per (axis, kind): how many calls and how many bytes."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def add(self, axis: str, kind: str, num_bytes: int) -> None:
        self.calls[(axis, kind)] += 1
        self.bytes[(axis, kind)] += num_bytes

    def as_rows(self) -> dict[tuple[str, str], tuple[int, int]]:
        return {key: (self.calls[key], self.bytes[key]) for key in sorted(self.calls)}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class CollectiveCounter(TorchDispatchMode):
    """Within `with CollectiveCounter(axes) as counter:`, every collective lands in `counter.counts`.

    `axes` maps the set of global ranks a group spans to its axis ("dp", "tp", "pp", "cp", "world"):
    groups are matched by their members, since sub-meshes may hold their own communicators for
    the same ranks. A key that is a group's name instead names that one communicator, ahead of its
    members: the dp x cp gradient group ("dp_cp") spans the same ranks as cp alone when dp = 1.
    A group not listed is counted under "other", so nothing goes unseen.
    """

    def __init__(self, axes: dict[frozenset[int] | str, str]) -> None:
        super().__init__()
        self.axes = axes
        self.counts = CollectiveCounts()
        self._members: dict[str, frozenset[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            # Modes run before tensor subclasses: step aside so DTensor lowers the op, and the
            # collectives it issues (redistributions, loss-parallel reductions) come back here.
            return NotImplemented
        namespace, name = func.namespace, func._opname
        if namespace == "c10d" and name in _C10D:
            kind, which = _C10D[name]
            group = next((a for a in args if isinstance(a, torch.ScriptObject) and _is_group(a)), None)
            axis = self._axis(dist.ProcessGroup.unbox(group) if group is not None else None)
            tensors = args[0] if which == "first" else args[1]
            self.counts.add(axis, kind, _nbytes(tensors))
        elif namespace in ("_c10d_functional", "_c10d_functional_autograd") and name in _FUNCTIONAL:
            kind = _FUNCTIONAL[name]
            group_name = args[-1] if isinstance(args[-1], str) else kwargs.get("group_name")
            size = _nbytes(args[0])
            if kind == "all_gather" and name == "all_gather_into_tensor":
                size *= int(args[1])  # group size: the gathered output
            group = _resolve_process_group(group_name) if group_name is not None else None
            self.counts.add(self._axis(group), kind, size)
        return func(*args, **kwargs)

    def _axis(self, group) -> str:
        if group is None:
            return "other"
        name = group.group_name
        if name in self.axes:
            return self.axes[name]
        if name not in self._members:
            self._members[name] = frozenset(dist.get_process_group_ranks(group))
        return self.axes.get(self._members[name], "other")


def _is_group(value: torch.ScriptObject) -> bool:
    try:
        dist.ProcessGroup.unbox(value)
    except RuntimeError:
        return False
    return True


def group_axes(parallel) -> dict[frozenset[int] | str, str]:
    """The ranks of this rank's mesh-axis groups, tied-weight groups and the world, to their axis.

    A mesh axis spanning the whole world shares the world's ranks: its name wins (the cost model's
    ledger merges "world" into it the same way, `cost_models.collectives.merge_world`).
    """
    axes = {frozenset(range(dist.get_world_size())): "world"}
    if parallel.expert_groups is not None:  # ep groups and expert replicas (none when ep = dp: dp's own)
        axes.update(parallel.expert_groups.axes)
    for _, group, _ in parallel.tied_groups:  # tied embedding and head: a sum across pipeline ranks
        axes[frozenset(dist.get_process_group_ranks(group))] = "pp"
    for axis in ("pp", "dp", "cp", "tp"):
        axes[frozenset(dist.get_process_group_ranks(parallel.layout.group(axis)))] = axis
    if parallel.layout.size("cp") > 1:  # gradients over dp x cp: its own communicator, named
        axes[parallel.layout.gradient_group().group_name] = "dp_cp"
    return axes
