"""What the runtime can execute: the searcher offers nothing outside this table.

Shared by the searcher (which filters candidate strategies through `supports`) and the runtime
(issue #6), whose parity tests must cover every entry listed here; an entry is added only
together with the runtime code and tests that realize it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from autopar.plan_schema import Strategy


# Strategy knobs that say how other software implemented a run (`cost_models.implementation`):
# the runtime executes each at its default only.
IMPLEMENTATION_KNOBS = ("attention", "dropout", "dp_overlap", "tp_overlap", "optimizer_state")


@dataclass(frozen=True)
class TpBlock:
    """Linear weights the runtime shards together: either all R, or every input column parallel
    (S(0)) and every output row parallel (S(1)); it runs the inputs first, the outputs last."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class TpRules:
    """The tp placements the runtime executes, per parameter of one model, as pure data (no module),
    so the intra-op ILP can offer nothing else. All R is always allowed."""

    # Every alias of a tied weight is listed (with what all its modules allow).
    allowed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Linear bias -> its weight: the bias is S(0) exactly when the weight is (column parallel), else R.
    bias_follows: dict[str, str] = field(default_factory=dict)
    blocks: tuple[TpBlock, ...] = ()
    tied: tuple[tuple[str, ...], ...] = ()  # aliases of one parameter (the graph keeps one of the names)


@dataclass(frozen=True)
class Capabilities:
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    sequence_parallel: bool = True
    max_vp: int = 8
    max_zero_with_pipeline: int = 1  # see `supports`
    # Whether the runtime realizes per-parameter tp placements (of the model being planned): given
    # {parameter: "R" | "S(d)"}, None or the reason it cannot. The intra-op ILP's solutions are kept
    # only when this accepts them; None means no model is at hand and the ILP's placements are
    # trusted (what-if studies, benchmarks).
    check_placements: Callable[[dict[str, str]], str | None] | None = None
    # Why the model being planned cannot run tensor parallelism (tp > 1) or pipeline stages (pp > 1)
    # on this runtime, whatever the placements; None when it can, or when no model is at hand.
    tensor_parallel_refusal: str | None = None
    pipeline_refusal: str | None = None
    # The same runtime's rules as data, for the ILP to offer only what `check_placements` accepts;
    # None when no model is at hand (no rules).
    tp_rules: TpRules | None = None

    def supports(self, strategy: Strategy) -> str | None:
        """None when the runtime can execute `strategy`, else the reason it cannot."""
        for knob in IMPLEMENTATION_KNOBS:  # priced for other software; the runtime runs its defaults only
            value, runtime = getattr(strategy, knob), Strategy.model_fields[knob].default
            if value != runtime:
                return (f"{knob}={value} prices a run of other software; autopar's runtime runs {knob}={runtime} "
                        f"(leave {knob} out of --strategy to plan a run)")
        if strategy.schedule not in self.schedules:
            return f"the runtime has no {strategy.schedule} schedule"
        if strategy.zero not in self.zero_stages:
            return f"the runtime has no ZeRO stage {strategy.zero}"
        if strategy.recompute not in self.recompute:
            return f"the runtime has no {strategy.recompute} recompute"
        if strategy.sp and not self.sequence_parallel:
            return "the runtime has no sequence parallelism"
        if strategy.vp > self.max_vp:
            return f"the runtime runs at most {self.max_vp} virtual stages per rank"
        if strategy.tp > 1 and self.tensor_parallel_refusal:
            return self.tensor_parallel_refusal
        if strategy.pp > 1 and self.pipeline_refusal:
            return self.pipeline_refusal
        if strategy.pp > 1 and strategy.dp > 1 and strategy.zero > self.max_zero_with_pipeline:
            # torch.distributed.pipelining drives FSDP2 itself: it keeps gradients unsharded and weights
            # gathered between micro-batches and reduces once after the last one, which is ZeRO 1's
            # traffic and memory, not what ZeRO 2/3 are costed as.
            return (f"the runtime's pipeline schedules run ZeRO {strategy.zero} as ZeRO 1 (gradients reduced once "
                    f"per step, weights kept gathered between micro-batches): use zero ≤ "
                    f"{self.max_zero_with_pipeline} with pp > 1")
        return None


RUNTIME_CAPABILITIES = Capabilities()
