"""Compose the runtime's concerns into a model that trains as the plan says.

Order (as TorchTitan's parallelize step): mesh → pipeline stage → tensor/sequence parallel (module
rules, or DTensor through the model's forward, as the plan's `tp_realization` says) → context
parallel (attention over sequence shards) → recompute → expert parallel (each rank's experts kept,
all-to-alls around them; under ZeRO their own FSDP units over their replicas) → FSDP/ZeRO (over dp x
cp) → materialize local shards → schedule → dp (x cp) gradient buckets (zero 0; expert gradients over
their replicas). Tensor parallelism comes before FSDP so FSDP shards the DTensor parameters over dp;
recompute before FSDP so FSDP's hooks sit outside the checkpointed forward; expert parallelism before
FSDP so the blocks' units leave the expert slices to their own; materialization last, so every rank
only ever allocates its shards.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from autopar.errors import AutoparError
from autopar.gradient_norm import squares_sum
from autopar.graph.capture import model_fingerprint
from autopar.plan_schema import ZERO_BUBBLE_SCHEDULES, Plan
from autopar.capabilities import whole_stage_problem
from autopar.runtime.allocator import configure_allocator
from autopar.runtime.compile import compile_blocks, compile_forward_loss
from autopar.runtime.context_parallel import ContextParallel, apply_context_parallel, context_parallel_problem
from autopar.runtime.data_parallel import GradientBuckets, apply_fsdp, parameter_device, set_microbatch_boundary
from autopar.runtime.tensor_parallel.dtensor import step_context as dtensor_step_context
from autopar.runtime.expert_parallel import (ExpertGroups, apply_expert_parallel, build_expert_groups,
                                             expert_parallel_problem, gather_experts, shard_expert_states)
from autopar.runtime.gemm_padding import apply_gemm_padding
from autopar.runtime.init import InitSource, materialize
from autopar.runtime.mesh import RankLayout, build_layout
from autopar.runtime.optimizer import (build_optimizer, clear_gradient_scale, defer_gradient_scale, hand_found_inf,
                                      step_context)
from autopar.runtime.pipeline.schedule import (build_schedule, check_stage_cover, cut_pipeline, microbatch_inputs,
                                               retie_across_stages, tied_gradient_groups)
from autopar.runtime.loss_scaling import LossScale, loss_scale_for, overflowed, scaled_loss
from autopar.runtime.host_transfers import QueuedScalar, batch_to_device
from autopar.runtime.precision import autocast, fsdp_policy
from autopar.runtime.recompute import apply_recompute
from autopar.runtime.tensor_parallel.module_rules import apply_tensor_parallel, default_head_path, plan_refusal, tp_placement
from autopar.runtime.tensor_parallel.regather import shard_layers


@dataclass
class ParallelModel:
    """This rank's share of the model and the step that trains it."""

    plan: Plan
    layout: RankLayout
    modules: list[nn.Module]  # this rank's stage modules (one unless interleaved)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    precision: str
    schedule: object | None = None
    tied_groups: list[tuple[str, dist.ProcessGroup, list[int]]] = field(default_factory=list)  # (alias, group, pp ranks)
    vocab_parallel_loss: bool = False
    canonical: dict[str, str] = field(default_factory=dict)  # alias of a tied weight -> its first name
    gradient_buckets: GradientBuckets | None = None  # zero 0 over dp > 1: the sync overlapped with backward
    step_context: Callable = contextlib.nullcontext  # entered around each micro-batch's forward and backward
    expert_groups: ExpertGroups | None = None  # ep > 1
    expert_params: frozenset[str] = frozenset()  # names of this rank's expert slices (ep > 1)
    expert_buckets: GradientBuckets | None = None  # ep < dp: expert gradients summed over their replicas
    context: ContextParallel | None = None  # cp > 1: this rank's sequence shards and their loss
    forward_loss: Callable[[torch.Tensor], torch.Tensor] | None = None  # the stage and its loss compiled as one
    loss_scale: LossScale | None = None  # fp16: the dynamic loss scale (runtime/loss_scaling.py)
    optimizations: dict[str, str] = field(default_factory=dict)  # what the runtime applied, for the user

    @property
    def strategy(self):
        return self.plan.strategy

    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for module in self.modules:
            for param in module.parameters():
                seen.setdefault(id(param), param)
        return list(seen.values())

    def named_parameters(self) -> dict[str, nn.Parameter]:
        named: dict[str, nn.Parameter] = {}
        for module in self.modules:
            named.update(dict(module.named_parameters()))
        return named

    def build_optimizer(self, lr: float, **options) -> torch.optim.AdamW:
        """AdamW over this rank's parameters, fused where they allow it (runtime/optimizer.py)."""
        optimizer = build_optimizer(self.parameters(), lr, self.strategy.offload, **options)
        where = "on the host" if self.strategy.offload == "optimizer" else "on " + self.layout.device.type
        self.optimizations["optimizer"] = f"AdamW {'fused' if optimizer.defaults['fused'] else 'foreach'} {where}"
        return optimizer

    def is_first_stage(self) -> bool:
        return 0 in self.layout.stage_indices

    def is_last_stage(self) -> bool:
        return len(self.plan.stages) - 1 in self.layout.stage_indices

    def local_batch(self, global_batch: torch.Tensor) -> torch.Tensor:
        """This dp rank's rows of a global batch (every rank may load the same global batch)."""
        s = self.strategy
        rows = s.microbatch * s.num_microbatches
        if global_batch.shape[0] != rows * s.dp:
            raise AutoparError(f"global batch of {global_batch.shape[0]} sequences, the plan needs dp x microbatch x "
                               f"micro-batches = {s.dp} x {s.microbatch} x {s.num_microbatches} = {rows * s.dp}")
        start = self.layout.dp_rank * rows
        return batch_to_device(global_batch[start:start + rows], self.layout.device)

    def forward_backward(self, local: torch.Tensor) -> torch.Tensor:
        """Run every micro-batch forward and backward; returns the sum of micro-batch losses (0 off the last stage).
        Under fp16 the gradients are left multiplied by the loss scale (`clip_grad_norm_` divides them)."""
        s = self.strategy
        loss_context = loss_parallel if self.vocab_parallel_loss else contextlib.nullcontext
        total = torch.zeros((), device=self.layout.device)
        fsdp = s.zero >= 1
        scale = self.loss_scale.factor if self.loss_scale is not None else 1.0  # on the device: no host read
        with loss_context(), self.step_context():
            if self.schedule is not None:
                losses: list[torch.Tensor] = []
                with autocast(self.precision, self.layout.device, fsdp):
                    self.schedule.step(local, losses)  # its loss scaled (`scaled_loss`)
                for loss in losses:
                    total += _local_value(loss.detach()) / scale if self.loss_scale is not None else _local_value(loss.detach())
                return total
            module = self.modules[0]
            micro = local.chunk(s.num_microbatches)
            for index, x in enumerate(micro):
                last = index == len(micro) - 1
                if fsdp:
                    set_microbatch_boundary(list(module.modules()), s.zero, last)
                with autocast(self.precision, self.layout.device, fsdp):
                    if self.context is not None:  # this rank's positions of each sequence, their next tokens
                        tokens, targets = self.context.shard(module, x)
                        loss = self.context.loss(module(tokens), targets, x.shape[1])
                    elif self.forward_loss is not None:
                        loss = self.forward_loss(x)
                    else:
                        loss = self.loss_fn(module(x), x)
                # fp16: scaled in fp32, as GradScaler does (a 16-bit loss times 2^16 would overflow)
                (loss / s.num_microbatches if self.loss_scale is None else loss.float() * scale / s.num_microbatches
                 ).backward()
                total += _local_value(loss.detach())
        return total

    def sync_gradients(self) -> None:
        """What the step adds after backward: the dp buckets still in flight, then partial sums over tp
        (sequence-parallel norms) and tied weights across stages."""
        if self.gradient_buckets is not None:
            self.gradient_buckets.finish()
        named = self.named_parameters()
        if self.expert_buckets is not None:
            self.expert_buckets.finish()
        elif self.expert_params and self.strategy.zero == 0:
            # ep = dp: each expert's gradient holds every dp rank's share already (FSDP2 divides under ZeRO)
            s = self.strategy
            for name in self.expert_params:  # a pipeline schedule left the micro-batches' sum unscaled
                if named[name].grad is not None:
                    named[name].grad.div_(self.layout.size("dp") * (s.num_microbatches if s.pp > 1 else 1))
        _sum_partial_gradients(list(named.values()))
        for param in named.values():
            _match_gradient_placements(param)
        for name, group, _ in self.tied_groups:
            grad = named[name].grad
            if grad is not None:
                dist.all_reduce(_local_value(grad), group=group)

    def clip_grad_norm_(self, max_norm: float, optimizer: torch.optim.Optimizer | None = None,
                        loss_scale: float | torch.Tensor | None = None) -> torch.Tensor:
        """Global gradient norm over every shard and stage (one scalar all-reduce), then clip. On a GPU
        norms and scaling run as foreach kernels over the gradients that count alike (a few launches,
        not four per parameter: a launch-bound step pays for each); on the host, under offload, the
        norm runs by rows over its threads (`autopar.gradient_norm`). With a fused `optimizer` the
        scaling is its next step's instead (`runtime.optimizer.defer_gradient_scale`): one pass over
        every gradient fewer. `loss_scale`: the gradients are that multiple of the loss's (fp16; None:
        this model's current scale, 1 without one): the norm returned is theirs divided by it, and the
        scaling divides them by it too. Nothing here waits for the device."""
        if loss_scale is None:
            loss_scale = self.loss_scale.factor if self.loss_scale is not None else 1.0
        unscaled = not isinstance(loss_scale, torch.Tensor) and loss_scale == 1.0
        tied = {name: len(ranks) for name, _, ranks in self.tied_groups}
        groups: dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]] = {}
        seen: set[int] = set()  # a weight two of this rank's stages share (zbv's embedding and head): once
        for name, param in self.named_parameters().items():
            if param.grad is None or id(param) in seen:
                continue
            seen.add(id(param))
            grad = param.grad
            if isinstance(grad, DTensor):
                copies = math.prod(grad.device_mesh.size(i) for i, p in enumerate(grad.placements) if p.is_replicate())
                # replicated over the stage-mesh axes the DTensor does not span
                copies *= self._stage_size() // grad.device_mesh.size()
                if name in self.expert_params:  # sharded over the replicas, split over ep: no copies there
                    copies //= self.expert_groups.ep
                local = grad.to_local()
            else:
                copies, local = self._stage_size(), grad
                if name in self.expert_params:  # replicated over the dp/ep groups only
                    copies //= self.expert_groups.ep
            copies *= tied.get(name, 1)
            groups.setdefault((copies, local.device, local.dtype), []).append(local)
        squares = torch.zeros((), dtype=torch.float32, device=self.layout.device)
        for (copies, _, _), locals_ in groups.items():  # on the host under offload: `autopar.gradient_norm`
            squares += squares_sum(locals_).to(squares.device) / copies
        dist.all_reduce(squares)
        norm = squares.sqrt() if unscaled else squares.sqrt() / loss_scale
        if max_norm > 0 or not unscaled:
            # not finite (an overflow under a loss scale): any scaling, the step is skipped
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0) if max_norm > 0 else torch.ones_like(norm)
            if not unscaled:
                scale = scale / loss_scale
            devices = {device for _, device, _ in groups}
            if not defer_gradient_scale(optimizer, scale, devices):
                for (_, device, _), locals_ in groups.items():
                    torch._foreach_mul_(locals_, scale.to(device))
        return norm

    def _stage_size(self) -> int:
        return self.layout.size("dp") * self.layout.size("cp") * self.layout.size("tp")

    def global_loss(self, loss_sum: torch.Tensor) -> float:
        """Mean loss over the global batch, the same on every rank (one scalar all-reduce)."""
        return self.queued_global_loss(loss_sum).value()

    def queued_global_loss(self, loss_sum: torch.Tensor) -> QueuedScalar:
        """`global_loss` on its way to the host: the all-reduce is queued, nothing waits for it yet."""
        s = self.strategy
        value = loss_sum.detach().float().reshape(1)
        if not (self.is_last_stage() and self.layout.tp_rank == 0):
            value = torch.zeros_like(value)
        dist.all_reduce(value)
        return QueuedScalar(value, divisor=s.dp * s.cp * s.num_microbatches)  # cp ranks' losses are cp x their share

    def train_step(self, batch: torch.Tensor, optimizer: torch.optim.Optimizer, max_grad_norm: float = 0.0,
                   *, local: bool = False) -> float:
        """Forward, backward, gradient sync, clipping and the optimizer step; the global batch's mean loss.
        `batch` is the global batch (every rank passes the same one), or with `local=True` this dp rank's
        rows alone (a loader that reads no other rank's)."""
        return self.queued_train_step(batch, optimizer, max_grad_norm, local=local).value()

    def queued_train_step(self, batch: torch.Tensor, optimizer: torch.optim.Optimizer, max_grad_norm: float = 0.0,
                          *, local: bool = False) -> QueuedScalar:
        """`train_step` without waiting for the device: its loss comes back as a `QueuedScalar`, which a
        loop reads once the next step is queued (`runtime/host_transfers.py`)."""
        rows = batch_to_device(batch, self.layout.device) if local else self.local_batch(batch)
        loss_sum = self.forward_backward(rows)
        self.sync_gradients()
        # tp shards beside plain weights: torch's foreach and fused AdamW step them under implicit replication
        stepping = step_context([p for group in optimizer.param_groups for p in group["params"]])
        try:
            if self.loss_scale is not None:  # fp16: the norm says whether the scaled gradients overflowed
                found_inf = overflowed(self.clip_grad_norm_(max_grad_norm, optimizer))
                if hand_found_inf(optimizer, found_inf) or not found_inf.item():  # the fused step skips itself
                    with stepping:
                        optimizer.step()
                self.loss_scale.update(found_inf)
            else:
                if max_grad_norm > 0:
                    self.clip_grad_norm_(max_grad_norm, optimizer)
                with stepping:
                    optimizer.step()
        finally:  # a step that raised must not leave its deferred scale to the next one
            clear_gradient_scale(optimizer)
        optimizer.zero_grad(set_to_none=True)
        return self.queued_global_loss(loss_sum)

    def executed_placements(self) -> dict[str, str]:
        """Each parameter's placement over the stage mesh (dp, tp; dp, cp, tp under context parallelism)
        as it runs, in the plan's syntax ("S(0)R"): ZeRO's shards over dp x cp read S(0) on each of the
        two that has more than one rank (R at dp=1, as the plan writes it)."""
        axes = [axis.name for axis in self.plan.mesh if axis.name != "pp"]
        sizes = {axis.name: axis.size for axis in self.plan.mesh}
        flattened = tuple(axis for axis in ("dp", "cp") if sizes.get(axis, 1) > 1)  # a size-1 axis reads R
        result = {}
        for name, param in self.named_parameters().items():
            parts = {"dp": "R", "cp": "R", "tp": "R"}
            if isinstance(param, DTensor):
                for axis, placement in zip(param.device_mesh.mesh_dim_names, param.placements):
                    dim = getattr(placement, "dim", None)
                    text = "R" if placement.is_replicate() else ("P" if dim is None else f"S({dim})")
                    parts.update(dict.fromkeys(flattened if axis == "dp_cp" else (axis,), text))
            if name in self.expert_params:  # experts split over the ep group (Strategy.ep)
                parts["dp"] = "S(0)"
            result[self.canonical.get(name, name)] = "".join(parts[axis] for axis in axes)
        return result

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stage parameters gathered to full tensors under their canonical names (a
        collective over the stage mesh)."""
        def full(name: str, p: torch.Tensor) -> torch.Tensor:
            if name in self.expert_params:
                return gather_experts(p, self.expert_groups)
            return p.full_tensor() if isinstance(p, DTensor) else p

        return {self.canonical.get(name, name): full(name, p).detach().cpu().clone()
                for name, p in self.named_parameters().items()}


def _sum_partial_gradients(params: list[torch.Tensor]) -> None:
    """Sum the partial gradients of replicated weights in one all-reduce per mesh dimension.

    Under sequence parallelism a norm's weight sees one sequence shard per tp rank, so its gradient
    is a partial sum over tp; summing them one by one would cost a call per weight (as Megatron-LM
    does, these are flattened together).
    """
    pending: dict[tuple, list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if not (isinstance(param, DTensor) and isinstance(grad, DTensor)):
            continue
        partial = [i for i, p in enumerate(grad.placements) if p.is_partial()]
        if len(partial) != 1 or getattr(grad.placements[partial[0]], "reduce_op", None) != "sum":
            continue
        dim = partial[0]
        others_match = all(g == p for i, (g, p) in enumerate(zip(grad.placements, param.placements)) if i != dim)
        if others_match and param.placements[dim].is_replicate():
            pending.setdefault((id(grad.device_mesh), dim, grad.dtype), []).append(param)
    for (_, dim, _), group in pending.items():
        mesh = group[0].grad.device_mesh
        locals_ = [p.grad.to_local() for p in group]
        flat = torch.cat([g.reshape(-1) for g in locals_])
        dist.all_reduce(flat, group=mesh.get_group(dim))
        offset = 0
        for param, local in zip(group, locals_):
            summed = flat[offset:offset + local.numel()].view_as(local)
            offset += local.numel()
            param.grad = DTensor.from_local(summed, mesh, param.placements, run_check=False)


def _match_gradient_placements(param: torch.Tensor) -> None:
    """Give a DTensor gradient its parameter's placements.

    A vocabulary-parallel embedding's weight gradient comes back replicated (DTensor's embedding
    backward computes it whole on every tp rank); slicing it to the weight's shards costs no
    communication, and the tied-weight sum across pipeline ranks then adds matching shards.
    """
    grad = param.grad
    if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _local_value(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def parallelize(model: nn.Module, plan: Plan, *, loss_fn: Callable, seed: int = 0, precision: str = "fp32",
                head_path: str | None = None, compile: bool | None = None,
                example_inputs: tuple[torch.Tensor, ...] | None = None) -> ParallelModel:
    """Shard `model` (on meta, or with real weights) as `plan` says, on the running process group.

    `loss_fn(output, input_ids)` is the training loss; every rank calls this with the same arguments.
    `compile`: torch.compile the stage (runtime/compile.py); None: as the plan was priced. A plan priced
    compiled is refused eager: its memory counts what the compiled step saves. `example_inputs`: the model's
    inputs (any batch, any device, meta included) for pipeline stages to capture the forward at the
    micro-batch shape; by default the plan's `model_inputs`.
    """
    s = plan.strategy
    compile = s.compile if compile is None else compile
    if s.compile and not compile:
        raise AutoparError("this plan was priced compiled (its memory counts what the compiled step saves): "
                           "pass compile=True, or re-run `autopar plan` without compile")
    if compile and s.sp and s.sp_inputs == "regathered":
        raise AutoparError("this plan keeps sequence shards (sp_inputs=regathered), which runs eager only: "
                           "re-run `autopar plan` with compile")
    if compile and s.tp > 1 and plan.tp_realization == "dtensor":
        raise AutoparError("this plan's tensor parallelism runs through DTensor, which the runtime does not "
                           "compile: run it without compile, or re-run `autopar plan` with compile (it then "
                           "offers tp=1 only for this model)")
    fingerprint = model_fingerprint(model)
    if plan.provenance.model_fingerprint != fingerprint:
        raise AutoparError(
            f"the plan was made for model fingerprint {plan.provenance.model_fingerprint} "
            f"({plan.provenance.model_name}), this model is {fingerprint}: re-run `autopar plan` for this model"
        )
    unsupported = (plan_refusal(model, plan) or (expert_parallel_problem(model, s.ep) if s.ep > 1 else None)
                   or context_parallel_problem(model, s, _sequence_length(plan), loss_fn, plan.tp_realization))
    if unsupported:
        raise AutoparError(f"this plan cannot run: {unsupported}; re-run `autopar plan`, which only chooses what runs")
    cut = None
    if s.pp > 1:  # the forward captured (on fake tensors) and cut into stages, before any collective
        cut = cut_pipeline(model, plan, microbatch_inputs(plan, example_inputs), loss_fn)
        check_stage_cover(model, cut)
    placements = {name: tp_placement(text) for name, text in plan.param_placements.items()}
    head_path = head_path if head_path is not None else default_head_path(model)
    layout = build_layout(plan)  # 1. mesh (checks the world size before any collective)
    allocator = configure_allocator(layout.device)  # 1b. before this rank's first CUDA tensor
    source = InitSource(model, seed)
    # every alias of a tied weight carries its placement (a stage may hold only the head's alias)
    placements.update({alias: placements[name] for alias, name in source.alias.items() if name in placements})

    stage_units = {stage.index: stage.units for stage in plan.stages}
    modules: list[nn.Module] = []
    groups: ExpertGroups | None = None
    context: ContextParallel | None = None
    expert_names: list[str] = []
    shared: dict = {}  # this rank's stages share the copies of what they share (a tied weight)
    identities: list[dict[str, int]] = []  # per local stage: parameter name -> the object it was built as
    for index in layout.stage_indices:
        # 2. pipeline stage: the modules of this stage only (the whole model when pp=1)
        module = cut.stage_module(model, index, layout.device, shared) if cut else copy.deepcopy(model)
        identities.append({name: id(p) for name, p in module.named_parameters(remove_duplicate=False)})
        # 2b. misaligned linear layers at an aligned width, outputs sliced back (16-bit, tp = pp = 1)
        padding = apply_gemm_padding(module, s, precision)
        # 3. tensor / sequence parallel over the tp axis
        if s.tp > 1:
            apply_tensor_parallel(module, layout.mesh["tp"], placements, s.sp, head_path,
                                  vocab_parallel_loss=s.pp == 1, realization=plan.tp_realization,
                                  shard_layers=shard_layers(plan))
        # 4. context parallel: attention over the cp ranks' sequence shards
        if s.cp > 1:
            context = apply_context_parallel(module, layout, s)
        # 5. recompute the planned modules
        apply_recompute(module, plan.recompute_modules, s.recompute)
        blocks = _innermost([p for p in stage_units[index] if _is_block(module, p)])
        expert_rows = {}
        if s.ep > 1:  # 6. this rank's experts, tokens routed to their owners by all-to-all
            groups = groups or build_expert_groups(layout, s.ep)
            expert_rows = apply_expert_parallel(module, groups)
            expert_names += list(expert_rows)
            if s.zero >= 1:  # their states sharded over their replicas, units of their own
                shard_expert_states(module, groups, s.zero, layout.size("dp"), fsdp_policy(precision))
        # 7. ZeRO: FSDP2 units per block over the dp (x cp) ranks (their shards on the host under offload)
        if s.zero >= 1:
            apply_fsdp(module, layout.gradient_mesh(), s.zero, blocks, fsdp_policy(precision), s.offload)
        # 8. materialize this rank's shards (and experts) with the sharding-independent init
        materialize(module, source, layout.device, parameter_device(layout.device, s.offload), expert_rows)
        if compile and whole_stage_problem(s) is not None:  # 8b. compile each block, inside every wrapper above
            compile_blocks(module, blocks, split_backward=s.schedule in ZERO_BUBBLE_SCHEDULES,
                           inside_checkpoint=s.tp > 1 and s.recompute == "full")
        modules.append(module)
    retie_across_stages(modules, identities)  # 8c. materialized apart, a weight two local stages share is one again

    # Pipeline schedules pass plain tensors between stages and to the loss: logits are gathered there.
    vocab_parallel = s.tp > 1 and s.pp == 1 and head_path is not None and placements.get(
        source.canonical(f"{head_path}.weight"), "R") == "S(0)"
    dtensor = s.tp > 1 and plan.tp_realization == "dtensor"
    parallel = ParallelModel(plan=plan, layout=layout, modules=modules, loss_fn=loss_fn, precision=precision,
                             vocab_parallel_loss=vocab_parallel or dtensor,
                             step_context=dtensor_step_context if dtensor else contextlib.nullcontext)
    parallel.canonical = dict(source.alias)
    parallel.expert_groups, parallel.expert_params = groups, frozenset(expert_names)
    parallel.context = context
    parallel.loss_scale = loss_scale_for(precision, parallel.layout.device)
    if compile and whole_stage_problem(s) is None:  # 8b. the whole stage and its loss as one graph
        parallel.forward_loss = compile_forward_loss(modules[0], loss_fn)
    parallel.optimizations = {**applied_optimizations(model, s, compile), "GEMM padding": padding,
                              "allocator": allocator}
    if parallel.loss_scale is not None:
        parallel.optimizations["loss scaling"] = f"dynamic, from {parallel.loss_scale.scale:,.0f} (fp16)"
    replicas = layout.gradient_mesh().size()  # dp, or dp x cp: the ranks holding the same weights
    buckets = s.zero == 0 and replicas > 1
    if cut is not None:  # 9. the pipeline schedule over this rank's stages
        parallel.tied_groups = tied_gradient_groups(model, cut, layout, parallel.named_parameters(), s.schedule)
        parallel.schedule = build_schedule(cut, modules, layout.stage_indices, layout.device,
                                           layout.group("pp"), s.schedule, s.num_microbatches,
                                           loss_fn if parallel.loss_scale is None else scaled_loss(loss_fn, parallel),
                                           scale_grads=not buckets, zero=s.zero if replicas > 1 else 0)
    if buckets:  # 10. dp (x cp) sync in buckets, overlapped with the last backward (they average over micro-batches too)
        named = parallel.named_parameters()
        experts = {id(named[name]) for name in parallel.expert_params}
        parallel.gradient_buckets = GradientBuckets(
            [p for p in parallel.parameters() if id(p) not in experts], layout.gradient_group(),
            accumulations=s.num_microbatches, divide_by=replicas * (s.num_microbatches if s.pp > 1 else 1))
        if groups is not None and groups.replica_group is not None:
            parallel.expert_buckets = GradientBuckets(
                [p for p in parallel.parameters() if id(p) in experts], groups.replica_group,
                accumulations=s.num_microbatches,
                divide_by=layout.size("dp") * (s.num_microbatches if s.pp > 1 else 1))
    return parallel


def applied_optimizations(model: nn.Module, strategy, compile: bool) -> dict[str, str]:
    """What the runtime does beyond the plan's layout, each in a few words (`autopar run` prints it)."""
    config = getattr(model, "config", None)
    vocab, padded = getattr(config, "vocab", None), getattr(config, "padded_vocab", None)
    done = {"vocab padding": f"{vocab:,} -> {padded:,} rows (padded logits masked)" if padded and padded != vocab
            else "none needed" if padded else "not applied (not a zoo model)"}
    problem = whole_stage_problem(strategy)
    done["compile"] = ("off" if not compile else "whole stage with its loss" if problem is None
                       else f"per block ({problem})")
    return done


def _sequence_length(plan: Plan) -> int | None:
    """The planned sequence length: the token ids' per-sample shape, when the plan records it."""
    inputs = plan.model_inputs
    return inputs[0].shape[0] if inputs and len(inputs[0].shape) == 1 else None


def _is_block(module: nn.Module, path: str) -> bool:
    """A layer unit of the plan (a repeated layer's instance, not the "pre"/"between"/"post" glue
    around them) that shares no parameter with the rest: its own FSDP unit, as the ledger prices
    it (`cost_models.collectives`: each layer a unit, the rest of the stage the root's)."""
    if path in ("pre", "post") or path.startswith("between."):
        return False
    try:
        sub = module.get_submodule(path)
    except AttributeError:
        return False
    if sub is module or not any(True for _ in sub.parameters()):
        return False
    inside = {id(p) for p in sub.parameters()}
    outside = {id(p) for name, p in module.named_parameters(remove_duplicate=False)
               if not name.startswith(path + ".")}
    return not inside & outside


def _innermost(blocks: list[str]) -> list[str]:
    """Blocks that contain no other block: a container of layers (Hugging Face's `model` around
    `model.layers.N`) is not a unit of its own; its other parameters join the root unit."""
    return [b for b in blocks if not any(o != b and o.startswith(b + ".") for o in blocks)]
