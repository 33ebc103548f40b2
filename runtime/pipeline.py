"""Pipeline stages cut from the plan's module lists, run by torch.distributed.pipelining schedules.

A stage is the model with the modules of other stages removed (set to None, or deleted from a
layer container), so parameter names stay those of the full model. The model's forward must skip
what is None (the zoo's models do): that is how a stage maps its input to its output.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B

from autopar.errors import AutoparError
from autopar.plan_schema import Plan

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


def stage_module(reference: nn.Module, module_paths: list[str]) -> nn.Module:
    """A copy of `reference` holding only the modules listed (and those without parameters)."""
    stage = copy.deepcopy(reference)
    keep = set(module_paths)
    for name, child in list(stage.named_children()):
        if name in keep:
            continue
        nested = [k for k in keep if k.startswith(name + ".")]
        if nested:
            for inner, _ in list(child.named_children()):
                path = f"{name}.{inner}"
                if path not in keep and any(p.numel() for p in child.get_submodule(inner).parameters()):
                    if any(k.startswith(path + ".") for k in keep):
                        raise AutoparError(f"plan splits inside {path}: stages must hold whole layers")
                    delattr(child, inner)
        elif any(True for _ in child.parameters()):
            setattr(stage, name, None)
    return stage


def pipeline_refusal(model: nn.Module) -> str | None:
    """Why `stage_module` cannot cut `model` into stages, or None.

    Stages are cut at the root's children and at the blocks of a root-level container, and the
    root's forward skips what is removed. Repeated blocks nested deeper (Hugging Face's
    `model.layers.N` inside a `LlamaModel` whose forward calls every part) cannot be cut that way.
    """
    for path, module in model.named_modules():
        if not path or not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        blocks = [child for child in module.children() if any(True for _ in child.parameters())]
        if len(blocks) < 2 or len({type(b) for b in blocks}) != 1:
            continue
        if "." in path:
            parent = path.rpartition(".")[0]
            return (f"the runtime cuts pipeline stages only at the root's children and the blocks of a root-level "
                    f"container; the repeated blocks of {path!r} sit inside {parent!r} "
                    f"({type(model.get_submodule(parent)).__name__}), whose forward runs them all")
        return None  # the outermost repeated blocks are cuttable (any nested inside them are not cut)
    return None


def check_stage_cover(reference: nn.Module, plan: Plan) -> None:
    """Every parameter must live on some stage; a module listed must exist."""
    modules = dict(reference.named_modules())
    covered: set[int] = set()
    for stage in plan.stages:
        for path in stage.module_paths:
            if path not in modules:
                raise AutoparError(f"plan stage {stage.index} lists module {path!r}, which the model lacks: "
                                   f"re-run `autopar plan` for this model")
            covered.update(id(p) for p in modules[path].parameters())
    missing = [name for name, p in reference.named_parameters() if id(p) not in covered]
    if missing and plan.strategy.pp > 1:
        raise AutoparError(f"plan places no stage on parameters {missing[:3]}{' ...' if len(missing) > 3 else ''}: "
                           f"re-run `autopar plan`")


def build_schedule(stages: list[nn.Module], stage_indices: list[int], num_stages: int, device: torch.device,
                   group: dist.ProcessGroup, schedule: str, num_microbatches: int, loss_fn, scale_grads: bool = True):
    """`scale_grads=False`: the schedule leaves gradients summed over micro-batches (the caller averages)."""
    pipeline_stages = [PipelineStage(module, index, num_stages, device, group=group)
                       for module, index in zip(stages, stage_indices)]
    kind = SCHEDULES[schedule]
    if schedule == "interleaved":
        return kind(pipeline_stages, n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    if len(pipeline_stages) != 1:
        raise AutoparError(f"schedule {schedule} runs one stage per rank, the plan gives {len(pipeline_stages)}")
    return kind(pipeline_stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)


def tied_pp_ranks(reference: nn.Module, plan: Plan) -> dict[str, list[int]]:
    """Tied parameters whose aliases sit on different pipeline ranks: canonical name -> those pp ranks."""
    aliases: dict[int, list[str]] = {}
    for name, param in reference.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    result: dict[str, list[int]] = {}
    for names in aliases.values():
        if len(names) < 2:
            continue
        ranks = sorted({stage.index % plan.strategy.pp for stage in plan.stages for name in names
                        for path in stage.module_paths if name.startswith(path + ".")})
        if len(ranks) > 1:
            result[names[0]] = ranks
    return result
