"""A plan checked against the model it is to run: what the runtime would refuse, found before any
process group starts (`autopar.load_plan(path, model=...)` calls it), so a hand-edited plan is refused
by `autopar run --dry-run`, `autopar inspect --check-plan` and `autopar run` alike.

The rules are the runtime's own where it exposes them (its capability table and tensor-parallel
placement check); the pipeline cut rule restates runtime/pipeline/schedule.py's `stage_module` without
copying the model once per stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.models.hints import model_hints
from autopar.plan_schema import Plan, load_plan


def load_plan_for_model(path: str | Path, model: Any) -> Plan:
    """`load_plan` for `model` (an nn.Module): the plan must carry its fingerprint and be one the
    runtime can execute for it."""
    from autopar.graph.capture import model_fingerprint

    plan = load_plan(path, expected_fingerprint=model_fingerprint(model))
    problem = plan_problem_for_model(plan, model)
    if problem:
        raise AutoparError(f"plan {Path(path)} cannot run on this model: {problem}; re-run `autopar plan` for it")
    return plan


def plan_problem_for_model(plan: Plan, model: Any) -> str | None:
    """What in `plan` the runtime would refuse for `model` (an nn.Module), or None: the same rules the
    searcher plans under, checked before any process group starts, so a hand-edited plan is refused
    by `--dry-run`, `inspect --check-plan` and `run` alike."""
    from autopar.runtime.tensor_parallel.module_rules import check_tp_placements, plan_refusal, tp_placement

    s = plan.strategy
    unsupported = plan_refusal(model, plan)  # a dtensor tp plan was dry-run: the module rules do not bind it
    if unsupported:
        return unsupported
    if s.ep > 1:
        from autopar.runtime.expert_parallel import expert_parallel_problem

        problem = expert_parallel_problem(model, s.ep)
        if problem:
            return problem
    if s.cp > 1:
        from autopar.runtime.context_parallel import context_parallel_problem

        inputs = plan.model_inputs
        problem = context_parallel_problem(model, s, inputs[0].shape[0] if inputs and len(inputs[0].shape) == 1
                                           else None, tp_realization=plan.tp_realization)
        if problem:
            return problem
    hints = model_hints(model)
    if hints["heads"] and hints["heads"] % s.tp:
        return f"tp={s.tp} does not divide the model's {hints['heads']} attention heads"
    kv_heads = hints["kv_heads"]
    if kv_heads and kv_heads % s.tp and s.tp % kv_heads:
        return f"tp={s.tp} and the model's {kv_heads} key/value heads do not divide one another"
    modules = dict(model.named_modules())
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for stage in plan.stages:
        missing = [path for path in stage.module_paths if path not in modules]
        if missing:
            return f"stage {stage.index} lists module {missing[0]!r}, which the model lacks"
    if s.pp > 1:
        problem = _stage_cut_problem(plan, model)
        if problem:
            return problem
    unknown = [path for path in plan.recompute_modules if path not in modules]
    if unknown:
        return f"recompute_modules names {unknown[0]!r}, which the model lacks"
    unknown = sorted(set(plan.param_placements) - parameters)
    if unknown:
        return f"param_placements names {unknown[0]!r}, which is not a parameter of the model"
    if s.tp > 1 and plan.tp_realization == "modules":
        return check_tp_placements(model, {name: tp_placement(text) for name, text in plan.param_placements.items()},
                                   s.sp)
    return None


def _prefixes(name: str) -> list[str]:
    """`a.b.c` -> [`a`, `a.b`]: the modules a parameter name lies inside."""
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]


def _stage_cut_problem(plan: Plan, model: Any) -> str | None:
    """Pipeline stages are cut at the root's children and the blocks of a root-level container
    (runtime/pipeline/schedule.py): a stage lists whole blocks, and every parameter lives on some stage."""
    listed_anywhere: set[str] = set()
    for stage in plan.stages:
        listed = set(stage.module_paths)
        for path in stage.module_paths:
            block = ".".join(path.split(".")[:2])
            if block != path and block not in listed:
                return (f"stage {stage.index} lists {path!r} without the rest of {block!r}: a stage holds whole "
                        f"layers")
        listed_anywhere |= listed
    # By name, not by tensor: a tied head shares the embedding's weight, but a stage must still run it.
    missing = [name for name, _ in model.named_parameters(remove_duplicate=False)
               if not any(path in listed_anywhere for path in _prefixes(name))]
    if missing:
        return f"no stage runs parameter {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    return None
