"""Expert parallelism (Strategy.ep): each rank keeps E/ep experts of every MoE layer.

The dp ranks form groups of ep consecutive ranks (`ep_group`); rank j of a group keeps experts
[j·E/ep, (j+1)·E/ep) of each layer. The zoo's MoE (`autopar.models.moe`) hands its experts one
[E, tokens, hidden] buffer; here a hook on the experts module sends each expert's rows to the rank
holding it (the functional `all_to_all_single`, equal splits: the capacity pads every queue, so the bytes are the
ledger's whatever the routing), the rank runs its experts on the rows of the whole group, and a
second all-to-all sends the results back in the buffer's order. Both are differentiable, their
backward the transposed all-to-all, so the experts' gradients sum over the group's tokens.

Gradients: the non-expert parameters are data parallel as before; an expert's gradient already
holds its whole ep group's contribution, so it is summed only over the dp/ep groups that hold
the same experts (`replica_group`, none when ep = dp) and divided by dp like every gradient:
under ZeRO 0 in the runtime's buckets, under ZeRO 1-3 by FSDP2, each MoE layer's expert slices
one unit sharded over their replicas (`shard_expert_states`, TorchTitan's layout).
As costed in `cost_models.experts`, and counted by `runtime.collectives` (axis "dp" when the ep
group is the dp group, else "ep"; the replicas' sum on "edp").
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from autopar.cost_models.experts import expert_shard_dim
from autopar.models.moe import MoE


def _all_to_all(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Equal-split all-to-all over dim 0, differentiable (its gradient is the same exchange back).
    The functional collective, so selective recompute saves its output (`runtime.recompute`)
    instead of sending it again."""
    out = funcol.all_to_all_single_autograd(tensor.contiguous(), None, None, group)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


@dataclass
class ExpertGroups:
    """This rank's ep group (its experts' owners), the dp/ep replicas of its experts, its place."""

    ep: int
    ep_rank: int
    ep_group: dist.ProcessGroup
    replica_group: dist.ProcessGroup | None  # None when ep = dp: the experts have no replicas
    axes: dict[frozenset[int], str]  # this rank's new groups' ranks -> their ledger axis, for the collective counter
    replica_mesh: DeviceMesh | None = None  # the replicas as a 1-D mesh (of one rank when ep = dp), for FSDP2


def build_expert_groups(layout, ep: int) -> ExpertGroups:
    """The (pp, dp, tp) mesh with dp unfolded into (dp/ep, ep): the ep groups are ep consecutive dp
    ranks, the replicas dp/ep ranks a stride of ep apart (of one rank when ep = dp)."""
    dp, tp, pp = layout.size("dp"), layout.size("tp"), layout.size("pp")
    mesh = init_device_mesh(layout.device.type, (pp, dp // ep, ep, tp), mesh_dim_names=("pp", "edp", "ep", "tp"))
    replicas = mesh["edp"]
    axes = {}
    if ep < dp:
        axes[frozenset(dist.get_process_group_ranks(mesh.get_group("ep")))] = "ep"
        axes[frozenset(dist.get_process_group_ranks(mesh.get_group("edp")))] = "edp"
    return ExpertGroups(ep, layout.dp_rank % ep, mesh.get_group("ep"),
                        mesh.get_group("edp") if ep < dp else None, axes, replicas)


def expert_parallel_problem(model: nn.Module, ep: int) -> str | None:
    """Why `model`'s experts cannot be split over `ep` ranks (checked before any collective), or None."""
    layers = [(path, moe) for path, moe in model.named_modules() if isinstance(moe, MoE)]
    if not layers:
        return (f"the plan splits experts over ep={ep} ranks but the model has no MoE block of the zoo's "
                f"(autopar.models.moe)")
    for path, moe in layers:
        if moe.num_experts % ep:
            return f"ep={ep} does not divide the {moe.num_experts} experts of {path}"
    return None


def apply_expert_parallel(module: nn.Module, groups: ExpertGroups) -> dict[str, tuple[int, int]]:
    """Keep this rank's experts of every MoE layer (on meta before materialization, so only they are
    ever allocated) and route tokens to their owners around each experts module; returns each expert
    parameter's rows of the full tensor, by name, for `runtime.init.materialize`. The model was
    checked by `expert_parallel_problem` before any collective."""
    names = {}
    for path, moe in module.named_modules():
        if not isinstance(moe, MoE):
            continue
        local = moe.num_experts // groups.ep
        start = groups.ep_rank * local
        for attr, param in list(moe.experts.named_parameters(recurse=False)):
            kept = nn.Parameter(param.detach()[start:start + local].clone(), requires_grad=param.requires_grad)
            setattr(moe.experts, attr, kept)
            names[f"{path}.experts.{attr}" if path else f"experts.{attr}"] = (start, start + local)
        moe.experts.register_forward_pre_hook(_dispatch(groups))
        moe.experts.register_forward_hook(_combine(groups))
    return names


def shard_expert_states(module: nn.Module, groups: ExpertGroups, zero: int, dp: int,
                        mixed_precision: MixedPrecisionPolicy | None) -> None:
    """ZeRO over the experts' replicas: each MoE layer's expert slices one FSDP2 unit on the replica
    mesh (no collective when it is one rank), before the blocks' units over dp claim the rest.
    An expert's gradient already sums its ep group's tokens: FSDP2 sums it over the replicas and
    divides by dp, as every gradient."""
    replicas = groups.replica_mesh.size()

    def placement(param: nn.Parameter) -> Shard:
        return Shard(expert_shard_dim(tuple(param.shape), replicas))

    options = {"mesh": groups.replica_mesh, "reshard_after_forward": zero >= 3, "shard_placement_fn": placement}
    if mixed_precision is not None:
        options["mp_policy"] = mixed_precision
    # The combine all-to-all's output aliases its receive buffer (the functional wait returns its
    # input), which FSDP2 flags as a view in case the caller writes to it in place; the MoE block never does.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPExperts\) returned a view tensor")
    for moe in module.modules():
        if isinstance(moe, MoE):
            fully_shard(moe.experts, **options)
            moe.experts.set_gradient_divide_factor(float(dp))
            # over several replicas: a sum, then the division (else a pre-multiplied sum, which gloo lacks);
            # over one, FSDP2 only divides, and forcing the sum there would divide twice (torch 2.13)
            moe.experts.set_force_sum_reduction_for_comms(replicas > 1)


def _dispatch(groups: ExpertGroups):
    def hook(_module: nn.Module, args: tuple) -> tuple:
        buffer = args[0]  # [E, tokens, hidden], experts in owner order
        experts, tokens, hidden = buffer.shape
        received = _all_to_all(buffer, groups.ep_group)  # [ep (source), E/ep, tokens, hidden]
        local = experts // groups.ep
        rows = received.view(groups.ep, local, tokens, hidden).transpose(0, 1)
        return (rows.reshape(local, groups.ep * tokens, hidden),)

    return hook


def _combine(groups: ExpertGroups):
    def hook(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
        local, rows, hidden = output.shape
        tokens = rows // groups.ep
        back = output.view(local, groups.ep, tokens, hidden).transpose(0, 1).reshape(local * groups.ep, tokens, hidden)
        return _all_to_all(back, groups.ep_group)  # [E, tokens, hidden] in the buffer's order

    return hook


def gather_experts(tensor: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """The whole [E, ...] tensor from each rank's [E/ep, ...] slice (a collective over the ep group;
    first over the replicas when ZeRO shards the slice)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    local = tensor.detach().contiguous()
    chunks = [torch.empty_like(local) for _ in range(groups.ep)]
    dist.all_gather(chunks, local, group=groups.ep_group)
    return torch.cat(chunks)
