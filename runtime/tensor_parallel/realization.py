"""Which realization of tensor parallelism runs given placements on one model, and what it sends.

Two realizations (the plan names the one it was costed with, `Plan.tp_realization`):
- "modules": Megatron-style module rules (`runtime.tensor_parallel.module_rules`): column/row-parallel
  Linears and one input all-reduce per block; the faster one, and the only one with sequence
  parallelism and pipeline stages, but the model's code sees local shards;
- "dtensor": DTensor through the model's own forward (`runtime.tensor_parallel.dtensor`): runs what the
  rules refuse or what breaks on local shards (head-count reshapes, fused projections, convs).
Each is tried by a dry run (`runtime.tensor_parallel.dry_run`): the module rules first, where they accept the
placements, then DTensor. The first that runs is the realization, with the collectives its dry
run recorded; when neither runs, the last failure is the one-line reason for the refusal.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from autopar.capabilities import Capabilities, TpRealization
from autopar.errors import AutoparError
from autopar.runtime.tensor_parallel.dry_run import DTENSOR, MODULES, DryRunSpec, dry_run
from autopar.runtime.tensor_parallel.twin_dry_run import dry_run_on_twins

MAX_REPLICATED_MODULES = 4


def capabilities_for(model: nn.Module, example_input=None, loss_fn=None, precision: str = "fp32") -> Capabilities:
    """The runtime's capability table for `model`: the placement check bound to it, and what it cannot
    run at all (so the searcher never offers it).

    Given an example input (a batch of one, real or on meta, as the model's forward takes it) and
    the training loss `loss_fn(output, input)`, tensor parallelism is decided by dry runs of the
    planned placements (`TensorParallelRealizer`): the module rules where they run, DTensor through
    the model's forward elsewhere, priced from what the dry run sends. Without them, only the
    module rules are offered, as `module_rules.static_capabilities` checks them statically.
    """
    from autopar.runtime.tensor_parallel.module_rules import static_capabilities

    table = static_capabilities(model)
    if example_input is None:
        return table
    if loss_fn is None:
        raise AutoparError("capabilities_for got an example input without loss_fn: the dry run of tensor "
                           "parallelism runs the loss too; pass loss_fn(output, input)")
    realizer = TensorParallelRealizer(model, example_input, loss_fn, precision)
    # DTensor runs what the module rules refuse: the static refusal no longer binds (the rules still
    # bound the intra-op ILP's proposals, each of which is dry-run before it is priced).
    return dataclasses.replace(table, tensor_parallel_refusal=None, tp_realization=realizer)


class TensorParallelRealizer:
    """`Capabilities.tp_realization` for one model: dry runs, cached by their inputs."""

    def __init__(self, model: nn.Module, example_input: torch.Tensor, loss_fn: Callable, precision: str = "fp32"):
        from autopar.runtime.tensor_parallel.module_rules import default_head_path

        if isinstance(example_input, (tuple, list)):
            if len(example_input) != 1:
                raise ValueError("the tp dry run feeds the model one input tensor, as training does")
            example_input = example_input[0]
        self.model = model
        self.example_input = example_input
        self.loss_fn = loss_fn
        self.precision = precision
        self.head_path = default_head_path(model)
        self.aliases: dict[str, str] = {}  # any name of a tied parameter -> its first name
        first: dict[int, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            self.aliases[name] = first.setdefault(id(param), name)
        self._cache: dict[tuple, TpRealization] = {}
        self.dry_runs = 0  # how many ran (not cached): for tests and benchmarks
        self.twin_answers = 0  # of those, how many shallow twins answered

    def __call__(self, placements: dict[str, str], tp: int, sp: bool, microbatch: int,
                 recompute_policy: str = "none", recompute_paths: tuple[str, ...] = ()) -> TpRealization:
        """The realization of `placements` (by the names the plan uses); where DTensor fails inside a
        module, that module's sharded parameters are kept replicated and the dry run repeated, up to
        `MAX_REPLICATED_MODULES` times (the result then carries the placements that run, and notes)."""
        recompute = tuple(recompute_paths) if recompute_policy != "none" else ()
        policy = recompute_policy if recompute else "none"
        notes: list[str] = []
        current = dict(placements)
        for _ in range(MAX_REPLICATED_MODULES + 1):
            realization = self._cached(current, tp, sp, microbatch, policy, recompute)
            replicated = None if realization.runs else self._replicable(realization.failed_module, current)
            if replicated is None:
                break
            module, names = replicated
            current.update({name: "R" for name in names})
            notes.append(f"{module or 'the root'} keeps its parameters replicated: DTensor cannot shard it "
                         f"({realization.reason})")
        if current == placements:
            return realization
        return dataclasses.replace(realization, placements=current, notes=tuple(notes))

    def _cached(self, placements, tp, sp, microbatch, policy, recompute) -> TpRealization:
        placements = self._every_alias(placements)
        key = (tp, frozenset(placements.items()), sp, microbatch, policy, recompute)
        if key not in self._cache:
            self._cache[key] = self._realize(placements, tp, sp, microbatch, policy, recompute)
        return self._cache[key]

    def _replicable(self, module: str | None, placements: dict[str, str]) -> tuple[str, list[str]] | None:
        """(module, its sharded parameters by the plan's names): the innermost module around where the
        dry run failed that holds sharded parameters, or None (nothing left to replicate but the root's)."""
        if not module:
            return None
        while module:
            prefix = module + "."
            names = sorted({self.aliases.get(alias, alias) for alias in self.aliases if alias.startswith(prefix)})
            names = [name for name in names if placements.get(name, "R") != "R"]
            if names:
                return module, names
            module = module.rpartition(".")[0]
        return None

    def _realize(self, placements, tp, sp, microbatch, policy, recompute) -> TpRealization:
        from autopar.runtime.tensor_parallel.module_rules import check_tp_placements

        common = dict(tp=tp, placements=tuple(sorted(placements.items())), microbatch=microbatch,
                      precision=self.precision, recompute=recompute, recompute_policy=policy)
        reason = check_tp_placements(self.model, placements, sp)
        if reason is None:
            head_weight = placements.get(f"{self.head_path}.weight", "R") if self.head_path else "R"
            spec = DryRunSpec(realization=MODULES, sp=sp, head_path=self.head_path,
                              vocab_parallel_loss=head_weight == "S(0)", **common)
            outcome = self._run(spec)
            if outcome.ok:
                return TpRealization(MODULES, None, outcome.collectives)
            reason = outcome.reason
        if sp:
            return TpRealization(None, f"sequence parallelism runs only under the module rules, which fail here "
                                       f"({reason})")
        outcome = self._run(DryRunSpec(realization=DTENSOR, vocab_parallel_loss=True, **common))
        if outcome.ok:
            return TpRealization(DTENSOR, None, outcome.collectives)
        return TpRealization(None, outcome.reason, failed_module=outcome.failed_module)

    def _run(self, spec: DryRunSpec):
        """The dry run of `spec`: from shallow twins where they agree (`twin_dry_run`), else of the
        whole model."""
        self.dry_runs += 1
        answer = dry_run_on_twins(self.model, spec,
                                  lambda twin, twin_spec: dry_run(twin, self.example_input, self.loss_fn, twin_spec))
        if answer is not None:
            self.twin_answers += 1
            return answer
        return dry_run(self.model, self.example_input, self.loss_fn, spec)

    def _every_alias(self, placements: dict[str, str]) -> dict[str, str]:
        """Placements under every name of a tied parameter (the plan names it once)."""
        result = dict(placements)
        for alias, name in self.aliases.items():
            if name in placements and alias not in result:
                result[alias] = placements[name]
        return result
