"""Candidate strategies: every completion of the keys the user fixed, ranked by the cost model.

The searcher's outer loop: enumerate the completions of the free keys (dp/cp/tp/pp, micro-batch, ZeRO,
recompute, sp, schedule, vp, ep, cp_kind), keep what the runtime can execute and what breaks no rule, and rank
them with the closed-form pipeline estimate, each recomputing only the layers it needs to fit.
`what_if` simulates the best few exactly on Megatron's layout (no ILP, even stages): the quick
answer benchmarks use to price published configurations; `search` refines the same ranking with
the intra-op ILP and the inter-op dynamic program.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any, Callable, Iterator

from autopar.cluster import ClusterSpec
from autopar.errors import AutoparError
from autopar.plan_schema import ZERO_BUBBLE_SCHEDULES, Strategy
from autopar.cost_models.compute import DEFAULT_EFFICIENCY, Efficiency
from autopar.cost_models.evaluate import Evaluation, evaluate, partition, with_fewest_recomputed_layers
from autopar.cost_models.experts import fewest_experts
from autopar.cost_models.facts import ModelFacts
from autopar.cost_models.collectives import head_vocab
from autopar.cost_models.implementation import RUNTIME_PROFILE, as_run, is_runtime_profile, profile_of
from autopar.cost_models.stage_costs import CostCache
from autopar.cost_models.strategy import check_fixed_degrees, check_strategy, standalone_ends
from autopar.searcher.drafts import draft, drafts_allowed

MICROBATCH_CHOICES = (1, 2, 4, 8, 16, 32)
VP_CHOICES = (2, 3, 4, 6, 8)


def zero_bubble_vps(schedule: str) -> tuple[int, ...]:
    """Virtual stages per rank the zero-bubble schedules run: zbv's V is 2 chunks; interleaved_zb is
    ZB-H1 at 1 (Qi et al., ICLR 2024, §3.1) and takes interleaved's choices above it; the others 1."""
    return {"zbv": (2,), "interleaved_zb": (1, *VP_CHOICES)}.get(schedule, (1,))
CP_KINDS = ("ring", "ulysses")
# Context parallelism is offered for long sequences only, so that ordinary searches enumerate what they
# did (`--strategy cp=N` prices any length). Below 16K positions tp, sp and recompute fit a sequence's
# activations, and Llama 3 trained its 8K stage without cp, turning it on for 128K (Dubey et al. 2024,
# §3.3.2). And cp's exchange outgrows attention as a rank's chunk c = S/cp shrinks: a ring round hides
# the 4·c·g·d bytes of a K/V block pair (g key/value heads, head dim d, 2-byte elements) behind about
# 2·c²·h·d FLOPs of causal attention (h heads), so it needs c ≥ 2·F·g / (β·h): at the H100's attention
# rate (F ≈ 350 TFLOP/s of causal work, `cluster` figures) that is ~2,000·g/h positions over NVLink
# (β ≈ 360 GB/s) and ~15,000·g/h over a GPU's 400 Gb/s NIC. Chunks under 1,024 positions hide it on no link.
CP_MIN_SEQUENCE = 16384
CP_MIN_CHUNK = 1024


@dataclass(frozen=True)
class WhatIf:
    best: Evaluation | None  # fastest that fits, or None
    ranked: list[Evaluation]  # exact evaluations, best first (fitting ones first)
    candidates: int
    rejected: dict[str, int]  # rule → how many completions broke it


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def context_degrees(world_size: int, seq_len: int | None) -> list[int]:
    """The cp degrees the search offers: 1, and for a long sequence each divisor of the world size
    leaving every rank a chunk of at least `CP_MIN_CHUNK` positions (see the constants' comment)."""
    if not seq_len or seq_len < CP_MIN_SEQUENCE:
        return [1]
    return [d for d in _divisors(world_size) if d == 1 or seq_len // d >= CP_MIN_CHUNK]


def completions(fixed: dict[str, Any], world_size: int, global_batch: int,
                experts: int | None = None, seq_len: int | None = None) -> Iterator[Strategy]:
    """Every strategy with the fixed keys; the implementation profile is the fixed one or the
    runtime's (never enumerated: the searcher chooses only what the runtime runs). `experts`: the
    fewest experts of the model's MoE layers; ep is enumerated over the divisors of dp that divide
    it (1 only for a model without MoE layers). `seq_len`: cp is enumerated over `context_degrees`,
    each cp > 1 with both kinds (ring, ulysses) unless fixed."""
    for values in completion_values(fixed, world_size, global_batch, experts, seq_len):
        try:
            yield Strategy(**values)
        except ValueError:
            continue


def completion_values(fixed: dict[str, Any], world_size: int, global_batch: int, experts: int | None = None,
                      seq_len: int | None = None) -> Iterator[dict[str, Any]]:
    """`completions`' strategies as the keyword arguments of `Strategy`, not yet validated."""
    def choices(key: str, options) -> list:
        return [fixed[key]] if key in fixed else list(options)

    profile = profile_of(fixed)
    # Offload is never a free choice here: `search` and `what_if` offer it only when nothing fits
    # without it (`with_offload_when_nothing_fits`).
    offload = fixed.get("offload", "none")
    # What does not change from one completion to the next is looked up once (GPT-3 175B on 1,024
    # GPUs has 78,168 completions): the fixed keys, and the vp choices per schedule.
    compile_, fixed_counts = fixed.get("compile", False), fixed.get("recompute_layers")
    zeros, recomputes = choices("zero", (0, 1, 2, 3)), choices("recompute", ("none", "selective", "full"))
    vps_of: dict[str, list] = {}

    for tp, pp, cp in product(choices("tp", _divisors(world_size)), choices("pp", _divisors(world_size)),
                              choices("cp", context_degrees(world_size, seq_len))):
        if world_size % (tp * pp * cp):
            continue
        dp = world_size // (tp * pp * cp)
        if "dp" in fixed and fixed["dp"] != dp:
            continue
        per_replica = global_batch // dp if global_batch % dp == 0 else 0
        microbatches = [mb for mb in MICROBATCH_CHOICES if per_replica and per_replica % mb == 0]
        eps = choices("ep", [d for d in _divisors(dp) if experts and experts % d == 0] or [1])
        kinds = choices("cp_kind", CP_KINDS if cp > 1 else ("ring",))
        for mb, zero, recompute, sp, schedule in product(
            choices("microbatch", microbatches), zeros, recomputes,
            choices("sp", (False, True) if tp > 1 else (False,)),
            choices("schedule", ("1f1b", "interleaved", "gpipe", *ZERO_BUBBLE_SCHEDULES) if pp > 1 else ("1f1b",)),
        ):
            if zero > 0 and dp * cp == 1 and "zero" not in fixed and offload == "none":
                continue  # nothing to shard over (offload needs FSDP2, at any dp)
            vps = vps_of.get(schedule)
            if vps is None:
                vps = vps_of[schedule] = choices("vp", VP_CHOICES if schedule == "interleaved"
                                                 else zero_bubble_vps(schedule))
            for vp, ep, cp_kind in product(vps, eps, kinds):
                if dp % ep:
                    continue
                counts = fixed_counts
                if isinstance(counts, int):  # the same count on every stage
                    counts = (counts,) * (pp * vp)
                elif counts == "all":  # every layer: None, and `fit_recompute` leaves it so
                    counts = None
                yield dict(dp=dp, tp=tp, pp=pp, sp=sp, zero=zero, recompute=recompute, microbatch=mb,
                           num_microbatches=max(global_batch // (dp * mb), 1), schedule=schedule, vp=vp,
                           recompute_layers=counts, offload=offload, ep=ep, cp=cp, cp_kind=cp_kind,
                           compile=compile_, **profile)


def quick_evaluations(
    facts: ModelFacts, cluster: ClusterSpec, fixed: dict[str, Any], global_batch: int, *, layers: int,
    efficiency: Efficiency = DEFAULT_EFFICIENCY, supports: Callable[[Strategy], str | None] | None = None,
    overlap_grad_sync: bool = True, cache: CostCache | None = None, tp_realization: str | None = None,
) -> tuple[list[Evaluation], int, dict[str, int]]:
    """Every valid completion of `fixed`, costed with the closed-form pipeline estimate.
    `tp_realization`: `evaluate`'s (the module rules' where the runtime has no other way for this model).

    `supports(strategy)` may veto a completion with a reason (the runtime's capability table); it
    sees the strategy under the runtime's implementation profile, since a profile the user fixed
    is a what-if price, not a choice (the runtime refuses it when asked to run it).
    Returns (evaluations, completions tried, rejection reason → count); raises when none is valid.
    `cache`: the caller's, shared by these evaluations (a fresh one if None).
    """
    cache = cache if cache is not None else CostCache()
    facts = priced_as_run(facts, fixed)
    valid, count, rejected = valid_strategies(facts, cluster, fixed, global_batch, layers=layers, supports=supports)
    def quick_one(strategy: Strategy) -> Evaluation:
        return evaluate_fitted(facts, cluster, strategy, global_batch, exact=False, efficiency=efficiency,
                               overlap_grad_sync=overlap_grad_sync, fit=fit_recompute(fixed), cache=cache,
                               tp_realization=tp_realization)

    quick = [quick_one(strategy) for strategy in valid]
    variants = [quick_one(kept_shards(strategy)) for strategy, evaluation in zip(valid, quick)
                if shards_may_pay(strategy, evaluation, fixed)]
    quick += [evaluation for evaluation in variants if keeps_some_shards(evaluation, layers)]
    return quick, count, rejected


def kept_shards(strategy: Strategy) -> Strategy:
    return strategy.model_copy(update={"sp_inputs": "regathered"})


def shards_may_pay(strategy: Strategy, evaluation: Evaluation | None, fixed: dict[str, Any]) -> bool:
    """Whether keeping sequence shards (`sp_inputs=regathered`, which the runtime also runs) may beat
    `strategy`, which keeps gathered inputs: it keeps less but sends one more all-gather per block, so
    only where memory binds, in a plan that does not fit or recomputes (a layer that keeps shards may
    not need to); `evaluation`: `strategy`'s (None: whether it is a choice at all)."""
    if "sp_inputs" in fixed or not is_runtime_profile(fixed) or not strategy.sp or strategy.tp == 1 or strategy.compile:
        return False
    return evaluation is None or not evaluation.fits or evaluation.strategy.recompute != "none"


def keeps_some_shards(evaluation: Evaluation, layers: int) -> bool:
    """Whether a plan keeping sequence shards keeps any: not when it recomputes every layer, where it is
    its gathered twin (so it is dropped, and takes no place among the candidates refined)."""
    s = evaluation.strategy
    if s.recompute == "none":
        return True
    return s.recompute_layers is not None and sum(s.recompute_layers) < layers


def valid_strategies(facts: ModelFacts, cluster: ClusterSpec, fixed: dict[str, Any], global_batch: int, *,
                     layers: int, supports: Callable[[Strategy], str | None] | None = None
                     ) -> tuple[list[Strategy], int, dict[str, int]]:
    """The completions of `fixed` the runtime supports and no rule rejects, in enumeration order
    (`facts` as the fixed profile runs them); (valid, completions tried, rejection reason → count).
    Raises when none is valid."""
    check_fixed_degrees(fixed, cluster.world_size)
    rejected: dict[str, int] = {}
    valid: list[Strategy] = []
    count = 0
    experts = fewest_experts(facts.experts)
    end_units = standalone_ends(facts.units)
    as_runtime = not is_runtime_profile(fixed)  # completions carry the fixed profile: the runtime's unless fixed
    for values, strategy in _drafted(fixed, cluster.world_size, global_batch, experts, facts.seq_len, as_runtime):
        count += 1
        if supports is not None:
            reason = supports(strategy.model_copy(update=RUNTIME_PROFILE) if as_runtime else strategy)
        else:
            reason = None
        if reason is None:
            try:
                check_strategy(strategy, world_size=cluster.world_size, global_batch=global_batch, layers=layers,
                               heads=facts.heads, kv_heads=facts.kv_heads, experts=experts, seq_len=facts.seq_len,
                               end_units=end_units)
            except AutoparError as error:
                reason = str(error)
        if reason is not None:
            rejected[reason] = rejected.get(reason, 0) + 1
            continue
        valid.append(strategy if values is None else Strategy(**values))
    if not valid:
        if count == 1 and rejected:  # a fully fixed strategy that breaks a rule: say which
            raise AutoparError(next(iter(rejected)))
        raise AutoparError(_no_completion(fixed, cluster.world_size, global_batch, count, rejected))
    return valid, count, rejected


def _drafted(fixed: dict[str, Any], world_size: int, global_batch: int, experts: int | None, seq_len: int | None,
             as_runtime: bool) -> Iterator[tuple[dict[str, Any] | None, Any]]:
    """(values, draft) per completion, a Strategy built from the values only for those kept
    (`searcher.drafts`); (None, strategy) when drafts cannot stand in (a fixed value the schema would
    convert, or a fixed implementation profile, whose completions are asked as the runtime's copies)."""
    if as_runtime or not drafts_allowed(fixed, world_size, global_batch):
        return ((None, strategy) for strategy in completions(fixed, world_size, global_batch, experts, seq_len))
    return ((values, namespace) for values in completion_values(fixed, world_size, global_batch, experts, seq_len)
            if (namespace := draft(values)) is not None)


def _no_completion(fixed: dict[str, Any], world_size: int, global_batch: int, count: int,
                   rejected: dict[str, int]) -> str:
    """One line: which keys were fixed, the rule most completions broke, and what to change."""
    given = ",".join(f"{k}={v}" for k, v in fixed.items())
    where = f"--strategy {given}" if given else "the free strategy keys"
    if not count:
        return (f"no strategy completes {where} on {world_size} GPUs with global batch {global_batch}: "
                f"each degree must divide the world size and dp the global batch; change "
                f"{'those keys' if given else '--global-batch or --gpus'}")
    reason, times = _most_broken_rule(rejected)
    fix = f"change or drop {given}" if given else "change --global-batch or --gpus"
    return f"no valid strategy completes {where}: {times} of {count} completions break the rule '{reason}'; {fix}"


def _most_broken_rule(rejected: dict[str, int]) -> tuple[str, int]:
    """The rule most completions broke, counting one rule's messages together whatever numbers they
    name ("pp×vp = 8 stages ..." and "pp×vp = 16 stages ..."), and its most frequent message."""
    import re

    by_rule: dict[str, list[tuple[str, int]]] = {}
    for reason, times in rejected.items():
        by_rule.setdefault(re.sub(r"\d+", "#", reason), []).append((reason, times))
    messages = max(by_rule.values(), key=lambda group: sum(times for _, times in group))
    return max(messages, key=lambda item: item[1])[0], sum(times for _, times in messages)


def what_if(facts: ModelFacts, cluster: ClusterSpec, fixed: dict[str, Any], global_batch: int,
            *, layers: int, top_k: int = 5, efficiency: Efficiency | None = None,
            overlap_grad_sync: bool = True) -> WhatIf:
    """`overlap_grad_sync`: see `evaluate` (False prices Megatron-LM 2021's published runs)."""
    efficiency = efficiency or DEFAULT_EFFICIENCY
    facts = priced_as_run(facts, fixed)
    cache = CostCache()
    quick, count, rejected = quick_evaluations(facts, cluster, fixed, global_batch, layers=layers,
                                               efficiency=efficiency, overlap_grad_sync=overlap_grad_sync,
                                               cache=cache)
    quick.sort(key=lambda e: (not e.fits, e.step_time_s))
    ranked = [evaluate_fitted(facts, cluster, unfitted(e.strategy, fixed), global_batch, exact=True,
                              efficiency=efficiency, overlap_grad_sync=overlap_grad_sync, fit=fit_recompute(fixed),
                              cache=cache)
              for e in quick[:top_k]]
    ranked.sort(key=lambda e: (not e.fits, e.step_time_s))
    best = ranked[0] if ranked[0].fits else None
    return WhatIf(best=best, ranked=ranked, candidates=count, rejected=rejected)


def evaluate_fitted(facts: ModelFacts, cluster: ClusterSpec, strategy: Strategy, global_batch: int, *,
                    exact: bool, efficiency: Efficiency = DEFAULT_EFFICIENCY,
                    overlap_grad_sync: bool = True, fit: bool = True, cache: CostCache | None = None,
                    tp_realization: str | None = None) -> Evaluation:
    """`evaluate` on the even layer split, Megatron's head; with `fit`, a strategy that recomputes
    every layer comes back recomputing only the layers each stage needs to fit
    (`with_fewest_recomputed_layers`)."""
    stages = partition(facts, strategy.pp * strategy.vp)
    cache = cache if cache is not None else CostCache()

    def run(trial: Strategy) -> Evaluation:
        return evaluate(facts, cluster, trial, global_batch, exact=exact, efficiency=efficiency, stages=stages,
                        vocab=head_vocab(facts, trial), overlap_grad_sync=overlap_grad_sync, cache=cache,
                        tp_realization=tp_realization)

    evaluation = run(strategy)
    return with_fewest_recomputed_layers(evaluation, stages, run, cache) if fit else evaluation


def priced_as_run(facts: ModelFacts, fixed: dict[str, Any]) -> ModelFacts:
    """The facts as the fixed implementation profile runs them (`implementation.as_run`)."""
    profile = profile_of(fixed)
    return as_run(facts, profile["attention"], profile["dropout"])


def fit_recompute(fixed: dict[str, Any]) -> bool:
    """Recompute counts are the planner's to choose unless --strategy gave them (a count, or all)."""
    return "recompute_layers" not in fixed


def unfitted(strategy: Strategy, fixed: dict[str, Any]) -> Strategy:
    """The strategy before its recompute counts were fitted (on an estimate, or another partition),
    to fit them again; counts the user fixed stay."""
    if not fit_recompute(fixed) or strategy.recompute_layers is None:
        return strategy
    return strategy.model_copy(update={"recompute_layers": None})
