"""What the runtime can execute: the searcher offers nothing outside this table.

Shared by the searcher (which filters candidate strategies through `supports`) and the runtime
(issue #6), whose parity tests must cover every entry listed here; an entry is added only
together with the runtime code and tests that realize it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from autopar.plan_schema import ZERO_BUBBLE_SCHEDULES, Strategy


# Strategy knobs that say how other software implemented a run (`cost_models.implementation`):
# the runtime executes each at its default only.
IMPLEMENTATION_KNOBS = ("attention", "dropout", "dp_overlap", "tp_overlap", "optimizer_state", "zero3_fetch",
                        "optimizer_impl", "gemm_padding", "weight_passes", "sp_inputs")
# (knob, the runtime's value): read once, not per strategy `supports` checks
_RUNTIME_KNOBS = tuple((knob, Strategy.model_fields[knob].default) for knob in IMPLEMENTATION_KNOBS)
# Knobs the runtime also runs at another value, which the searcher chooses where it pays
# (`searcher.candidates.quick_evaluations`): keeping sequence shards instead of gathered inputs.
RUNTIME_ALTERNATIVES: dict[str, tuple] = {"sp_inputs": ("regathered",)}


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
class TpCollective:
    """One collective a tp rank sends, as a dry run of the planned placements recorded it."""

    phase: str  # forward | backward | recompute (per micro-batch) | step (once per step)
    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | ...
    bytes: int
    module: str  # innermost module path running it ("" for the root, the loss and the step)


@dataclass(frozen=True)
class TpRealization:
    """How the runtime realizes given tp placements on one model, found by a dry run.

    `name` is "modules" (Megatron-style module rules, `runtime.tensor_parallel.module_rules`), "dtensor"
    (DTensor through the model's own forward, `runtime.tensor_parallel.dtensor`) or None when neither runs
    (then `reason` says why, in one line). `collectives` is what one tp rank sends per micro-batch
    (and once per step) of the dry run's micro-batch size.
    """

    name: str | None
    reason: str | None = None
    collectives: tuple[TpCollective, ...] = ()
    failed_module: str | None = None  # where DTensor's dry run failed (innermost module; "" the root)
    # The placements that run, when the realizer had to keep some modules' parameters replicated
    # (DTensor could not shard them: `notes` says which and why); None: the placements asked for.
    placements: dict[str, str] | None = None
    notes: tuple[str, ...] = ()

    @property
    def runs(self) -> bool:
        return self.name is not None


@dataclass(frozen=True)
class Capabilities:
    # interleaved_zb and zbv: torch's zero-bubble schedules, with what `zero_bubble_problem` allows
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "interleaved_zb", "zbv")
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    sequence_parallel: bool = True
    max_vp: int = 8
    # Every ZeRO stage runs with pipeline stages (`runtime.pipeline.zero_stage`): 1 and 2 keep the
    # weights gathered through the step, 3 gathers them per use; gradients are reduced once per step
    # but under ZeRO 2, every micro-batch.
    # Optimizer-state offload: FSDP2's CPUOffloadPolicy (`runtime.data_parallel.apply_fsdp`), so it
    # needs FSDP2 (zero ≥ 1, over a dp mesh of any size, 1 included). Without tp and pp: the parity
    # tests cover dp only, and torch's pipeline stages drive FSDP2 themselves.
    offload: tuple[str, ...] = ("none", "optimizer")
    # Whether the runtime realizes per-parameter tp placements (of the model being planned): given
    # {parameter: "R" | "S(d)"}, None or the reason it cannot. The intra-op ILP's solutions are kept
    # only when this accepts them; None means no model is at hand and the ILP's placements are
    # trusted (what-if studies, benchmarks).
    check_placements: Callable[[dict[str, str]], str | None] | None = None
    # Why the model being planned cannot run tensor parallelism (tp > 1) or pipeline stages (pp > 1)
    # on this runtime, whatever the placements; None when it can, or when no model is at hand.
    tensor_parallel_refusal: str | None = None
    pipeline_refusal: str | None = None
    # Why the model cannot run sequence parallelism (tp > 1 with sp) whatever the placements; None when it can.
    sequence_parallel_refusal: str | None = None
    # The same runtime's rules as data, for the ILP to offer only what `check_placements` accepts;
    # None when no model is at hand (no rules).
    tp_rules: TpRules | None = None
    # With the model at hand and an example input (`runtime.tensor_parallel.realization.capabilities_for`):
    # given (placements, tp, sp, micro-batch size, recompute policy), the realization that runs
    # them and what it sends, found by a dry run (cached). None: no dry run, the module rules and
    # the graph's Megatron layout are trusted (what-if studies, the zoo through the CLI).
    tp_realization: Callable[[dict[str, str], int, bool, int, str], TpRealization] | None = None
    # Why a strategy's tensor parallelism cannot run (its Megatron layout's dry run failed, or it
    # runs only through DTensor, which has no sequence parallelism nor pipeline stages here);
    # set by the search, which knows the graph's layout.
    tp_refusal: Callable[[Strategy], str | None] | None = None
    # Expert parallelism (`runtime.expert_parallel`): the zoo's MoE block with its experts sharded over
    # ep groups of dp ranks, with data and pipeline parallelism (tp = 1), any recompute (full resends
    # each layer's forward all-to-alls, as priced; selective saves them), ZeRO 0 (expert gradients
    # summed over their replicas in the runtime's buckets) and ZeRO 1-3 (ZeRO ≤ 1 with pipeline stages,
    # as for every plan; no offload), each rank's expert slices FSDP2 units over their replicas: what
    # the parity tests cover.
    # `expert_parallel_refusal`: why the model being planned cannot run ep (no MoE layers, or MoE
    # layers of another kind); None when it can, or when no model is at hand.
    expert_parallel: bool = True
    expert_parallel_refusal: str | None = None
    # Context parallelism (`cost_models.context`; the runtime's on the cp-runtime branch): the zoo's causal
    # decoders (gpt, llama; not MoE) with each sequence split over cp ranks, ring or ulysses, beside dp and
    # module-rule tp without sequence parallelism, at ZeRO 0 or 3, any recompute, one pipeline stage.
    # `context_parallel_refusal`: why the model being planned cannot run cp; None when it can, or when
    # no model is at hand.
    context_parallel: bool = True
    context_parallel_refusal: str | None = None

    @property
    def supports_offload(self) -> bool:
        return "optimizer" in self.offload

    def supports(self, strategy: Strategy) -> str | None:
        """None when the runtime can execute `strategy`, else the reason it cannot. What the model itself
        cannot run (its tp or pp refusal) comes first: no other setting would change it."""
        if strategy.tp > 1 and self.tensor_parallel_refusal:
            return self.tensor_parallel_refusal
        if strategy.pp > 1 and self.pipeline_refusal:
            return self.pipeline_refusal
        if strategy.tp > 1 and strategy.sp and self.sequence_parallel_refusal:
            return self.sequence_parallel_refusal
        for knob, runtime in _RUNTIME_KNOBS:  # priced for other software; the runtime runs its own values only
            value = getattr(strategy, knob)
            others = RUNTIME_ALTERNATIVES.get(knob, ())
            if value != runtime and value not in others:
                runs = " or ".join(f"{knob}={v}" for v in (runtime, *others))
                return (f"{knob}={value} prices a run of other software; autopar's runtime runs {runs} "
                        f"(leave {knob} out of --strategy to plan a run)")
        if strategy.sp_inputs == "regathered" and strategy.sp and strategy.compile:
            return ("the runtime keeps sequence shards (sp_inputs=regathered) in eager blocks only: use "
                    "sp_inputs=gathered with compile")
        if strategy.schedule not in self.schedules:
            return f"the runtime has no {strategy.schedule} schedule"
        if strategy.zero not in self.zero_stages:
            return f"the runtime has no ZeRO stage {strategy.zero}"
        if strategy.recompute not in self.recompute:
            return f"the runtime has no {strategy.recompute} recompute"
        if strategy.offload not in self.offload:
            return f"the runtime has no offload={strategy.offload}"
        if strategy.offload != "none":
            if strategy.zero < 1:
                return ("offload=optimizer runs through FSDP2's CPU offload policy: it needs zero ≥ 1 (FSDP2 runs "
                        "on one GPU too)")
            if strategy.tp > 1 or strategy.pp > 1:
                return "the runtime offloads optimizer states with data parallelism only: use tp=1 and pp=1"
        if strategy.ep > 1:
            reason = self._expert_parallel_refusal(strategy)
            if reason:
                return reason
        if strategy.cp > 1:
            reason = self._context_parallel_refusal(strategy)
            if reason:
                return reason
        if strategy.sp and not self.sequence_parallel:
            return "the runtime has no sequence parallelism"
        if strategy.vp > self.max_vp:
            return f"the runtime runs at most {self.max_vp} virtual stages per rank"
        if strategy.tp > 1 and self.tp_refusal is not None:
            reason = self.tp_refusal(strategy)
            if reason:
                return reason
        if strategy.schedule in ZERO_BUBBLE_SCHEDULES and strategy.pp > 1:  # the narrowest rule: last
            return zero_bubble_problem(strategy)
        return None

    def _expert_parallel_refusal(self, strategy: Strategy) -> str | None:
        if not self.expert_parallel:
            return "the runtime has no expert parallelism"
        if self.expert_parallel_refusal:
            return self.expert_parallel_refusal
        if strategy.tp > 1:
            return "the runtime runs expert parallelism without tensor parallelism: use tp=1 with ep > 1"
        if strategy.offload != "none":
            return "the runtime's expert parallelism keeps optimizer states on the device: use offload=none with ep > 1"
        if strategy.pp > 1 and strategy.zero >= 2:
            return ("the runtime's expert parallelism runs pipeline stages with ZeRO ≤ 1 (what its parity tests "
                    "cover): use zero ≤ 1 with pp > 1")
        return None

    def _context_parallel_refusal(self, strategy: Strategy) -> str | None:
        if not self.context_parallel:
            return "the runtime has no context parallelism"
        if self.context_parallel_refusal:
            return self.context_parallel_refusal
        reason = context_parallel_strategy_problem(strategy)
        if reason:
            return reason
        if strategy.tp > 1 and self.tp_realization is not None:
            return ("the runtime's context parallelism runs module-rule tensor parallelism, and this model's tp is "
                    "decided by DTensor dry runs: use tp=1 with cp > 1")
        return None


def context_parallel_strategy_problem(strategy: Strategy) -> str | None:
    """Which of `strategy`'s other knobs the runtime's context parallelism does not run with, or None:
    one list for the searcher's table and the runtime's check (`runtime.context_parallel`)."""
    s = strategy
    if s.cp <= 1:
        return None
    if s.pp > 1:
        return "the runtime runs context parallelism without pipeline stages: use pp=1 with cp > 1"
    if s.sp:
        return "the runtime runs context parallelism without sequence parallelism: use sp=false with cp > 1"
    if s.ep > 1:
        return "the runtime runs context parallelism on dense models only: use ep=1 with cp > 1"
    if s.zero in (1, 2):
        return (f"the runtime shards over dp × cp with ZeRO 0 or 3 only (FSDP2 fully sharded): use zero=0 or "
                f"zero=3 with cp > 1, not zero={s.zero}")
    if s.offload != "none":
        return "the runtime does not offload optimizer states with context parallelism: use offload=none with cp > 1"
    return None


def zero_bubble_problem(strategy: Strategy) -> str | None:
    """Which of `strategy`'s other knobs torch's zero-bubble schedules (the backward split into an
    input-gradient and a deferred weight-gradient pass) do not run with here, or None: what the parity
    tests cover is pipeline stages alone, one dp replica, no recompute, eager or compiled per block
    (`runtime.compile.compile_blocks(split_backward=True)`)."""
    s = strategy
    if s.tp > 1 or s.cp > 1 or s.ep > 1:
        return (f"the runtime runs {s.schedule} on pipeline stages alone (its split backward is untested with tp, cp "
                f"and ep collectives): use tp=cp=ep=1 or another schedule")
    if s.dp > 1 or s.zero > 0:
        return (f"the runtime runs {s.schedule} without data parallelism (gradient buckets and FSDP2 are untested with "
                f"the deferred weight-gradient pass): use dp=1, zero=0 or another schedule")
    if s.recompute != "none":
        return (f"the runtime runs {s.schedule} without recompute (a checkpointed block would rebuild its activations "
                f"in the input-gradient pass and again in the weight-gradient pass): use recompute=none")
    return None


# Compiled blocks under the DTensor realization of tp (a model the module rules refuse, such as GPT-2's
# Conv1D projections): a block compiled in pieces around graph breaks hands on a DTensor output nothing
# differentiates, and AOTAutograd's backward then fails on its missing tangent (torch 2.13, found on
# Hugging Face GPT-2 at tp=2). The module rules' realization compiles (`test_hf_parity`).
DTENSOR_COMPILE_PROBLEM = "use compile=false, or tp=1 to compile"

RUNTIME_CAPABILITIES = Capabilities()


def gemm_padding_problem(strategy: Strategy, precision: str) -> str | None:
    """Why the runtime does not pad this plan's misaligned linear layers (None: it does,
    `runtime/gemm_padding.py`): only 16-bit GEMMs need it; pipeline stages are captured as graphs
    before the runtime would pad; tensor parallelism shards the weights the pad would read whole."""
    reasons = [text for text, applies in (
        ("not a 16-bit precision", precision not in ("bf16", "fp16")), ("pipeline stages", strategy.pp > 1),
        ("gemm_padding=false", not strategy.gemm_padding),
        ("tensor parallel shards", strategy.tp > 1)) if applies]
    return ", ".join(reasons) or None


def whole_stage_problem(strategy: Strategy) -> str | None:
    """Why this plan's stage cannot compile as one graph with its loss (None: it can): the runtime
    then compiles each block (`runtime.compile`), and the cost model fuses only the blocks' kernels."""
    reasons = [text for text, applies in (
        ("pipeline stages", strategy.pp > 1), ("tensor parallel DTensors", strategy.tp > 1),
        ("context parallel attention", strategy.cp > 1), ("expert all-to-alls", strategy.ep > 1),
        ("FSDP2 units (zero >= 1)", strategy.zero >= 1)) if applies]
    return ", ".join(reasons) or None
