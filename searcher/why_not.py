"""Why not the obvious alternatives: each row names a strategy a user might expect and why it loses, in numbers.

Rows: the runners-up, then the best member of each obvious family (pure data parallel, tensor
parallel inside a node only, no pipeline, for a MoE model expert parallel, and where the search
offers context parallelism the best plan without it, or with it when the chosen plan has none),
priced exactly as `refine` prices Megatron's layout and set against the chosen plan (the closest one when nothing fits). A row says how much slower it is
per token and which part of the step grew most, or which memory part overflows. A family with no
valid member among the ranked completions is priced on its own: without the keys of `--strategy`
it contradicts, and, when the global batch does not divide over its data-parallel ranks, at the
nearest batch that does (then per token). A family the rules exclude outright names the rule.
Rows that land on the same strategy are one row, their labels joined.

Everything here reads evaluations; the cost model stays the one that prices them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable

from autopar.cluster import ClusterSpec
from autopar.errors import AutoparError
from autopar.plan_schema import Strategy
from autopar.cost_models.experts import fewest_experts
from autopar.cost_models.collectives import head_vocab
from autopar.cost_models.compute import Efficiency
from autopar.cost_models.evaluate import Evaluation, evaluate
from autopar.cost_models.facts import ModelFacts
from autopar.cost_models.strategy import check_strategy, standalone_ends
from autopar.searcher.candidates import completions, fit_recompute, quick_evaluations

GiB = 2**30
SAME_SPEED = 1.005  # within 0.5% reads "as fast"
# Keys of --strategy a family may contradict: they are dropped when pricing it on its own.
_LAYOUT_KEYS = ("dp", "tp", "pp", "schedule", "vp", "cp", "cp_kind")


@dataclass
class WhyNot:
    label: str  # "runner-up", "pure data parallel", ...; joined with " / " when rows share a strategy
    strategy: Strategy | None  # None: no strategy of the family is valid here
    reason: str  # one line, with numbers
    slowdown: float | None = None  # its time per token over the chosen plan's
    fits: bool | None = None
    peak_memory_bytes: float | None = None
    global_batch: int | None = None  # the batch it was priced at, when not the one asked for


def why_not_rows(ranked: list, quick: list[Evaluation], facts: ModelFacts, cluster: ClusterSpec, global_batch: int,
                 efficiency: Efficiency, best, *, fixed: dict[str, Any], layers: int, runners_up: int = 4,
                 supports: Callable[[Strategy], str | None] | None = None, cache=None,
                 tp_realization: str | None = None) -> list[WhyNot]:
    """`ranked`: the refined candidates, best first (a row for each of the first `runners_up` after
    the first); `quick`: every valid completion, ranked; `cache`: the search's unit-cost cache;
    `tp_realization`: `evaluate`'s, as the search priced its completions."""
    reference = best.evaluation if best else ranked[0].evaluation
    fitted = fit_recompute(fixed)
    rows: list[WhyNot] = []
    seen: dict[Any, WhyNot | None] = {_key(reference.strategy, fitted): None}  # the chosen plan has no row
    for candidate in ranked[1:1 + runners_up]:
        _add(rows, seen, priced_row("runner-up", candidate.evaluation, reference), fitted)
    families = _layout_families(cluster)
    split = [e for e in quick if e.strategy.cp > 1]
    if reference.strategy.cp > 1:  # why the sequence is split: the best plan that does not split it
        families["no context parallel (cp=1)"] = {"cp": 1}
    elif split:  # cp was offered (a long sequence) and lost: its best member
        best_split = _best_of(split).strategy
        families[f"context parallel (cp={best_split.cp}, {best_split.cp_kind})"] = {"cp": best_split.cp,
                                                                                   "cp_kind": best_split.cp_kind}
    ep = _expert_degree(facts, cluster)
    if ep is not None:  # a MoE model: its experts over as many ranks as they split into
        families[f"expert parallel (ep={ep})"] = {"ep": ep}
    for label, degrees in families.items():
        members = [e for e in quick if all(getattr(e.strategy, k) == v for k, v in degrees.items())]
        without = rule = ""
        if members:
            choice, batch = _best_of(members).strategy, global_batch
        else:
            choice, batch, without, rule = _family_on_its_own(degrees, fixed, facts, cluster, global_batch,
                                                              efficiency, layers, supports, cache, tp_realization)
            if choice is None:
                _add(rows, seen, WhyNot(label, None, f"not possible here: {rule}"), fitted)
                continue
        exact = evaluate(facts, cluster, choice, batch, efficiency=efficiency, vocab=head_vocab(facts, choice),
                         cache=cache, tp_realization=tp_realization)  # as `refine` prices Megatron
        _add(rows, seen, priced_row(label, exact, reference, without=without, batch_rule=rule), fitted)
    return rows


def _layout_families(cluster: ClusterSpec) -> dict[str, dict[str, int]]:
    world = cluster.world_size
    tp_node = min(cluster.gpus_per_node, world)
    return {"pure data parallel": {"tp": 1, "pp": 1, "cp": 1},
            f"tensor parallel only (tp={tp_node})": {"tp": tp_node, "pp": 1, "cp": 1},
            "no pipeline (pp=1)": {"pp": 1}}


def _expert_degree(facts: ModelFacts, cluster: ClusterSpec) -> int | None:
    """The ep of the expert-parallel row: a MoE model's experts over as many ranks as they split into."""
    world, experts = cluster.world_size, fewest_experts(facts.experts)
    return max((d for d in range(2, world + 1) if world % d == 0 and experts and experts % d == 0), default=None)


def compared_groups(facts: ModelFacts, cluster: ClusterSpec) -> list[Callable[[Strategy], bool]]:
    """The groups of ranked completions whose best member (`_best_of`) `why_not_rows` may read: its
    families, the completions with context parallelism and those without. A ranking that omits
    completions must keep, of each group, every member `_best_of` could pick (`searcher.bounded`)."""
    groups = [dict(degrees) for degrees in _layout_families(cluster).values()]
    ep = _expert_degree(facts, cluster)
    groups += [{"cp": 1}] + ([{"ep": ep}] if ep is not None else [])

    def member_of(degrees: dict[str, int]) -> Callable[[Strategy], bool]:
        # asked of every valid completion (`searcher.bounded`): one attrgetter and one comparison
        read = attrgetter(*degrees)  # one key: its value; several: a tuple of them
        wanted = tuple(degrees.values()) if len(degrees) > 1 else next(iter(degrees.values()))
        return lambda s: read(s) == wanted
    return [member_of(degrees) for degrees in groups] + [lambda s: s.cp > 1]


def _best_of(evaluations: list[Evaluation]) -> Evaluation:
    """The fastest that fits; when none fits, the one closest to fitting (least memory)."""
    fitting = [e for e in evaluations if e.fits]
    if fitting:
        return min(fitting, key=lambda e: e.step_time_s)
    return min(evaluations, key=lambda e: e.peak_memory_bytes)


def _key(strategy: Strategy | None, fitted: bool) -> Any:
    """Rows are the same strategy when they differ at most in recompute counts the search fitted."""
    if strategy is None:
        return None
    return strategy.model_copy(update={"recompute_layers": None}) if fitted else strategy


def _add(rows: list[WhyNot], seen: dict[Any, WhyNot | None], row: WhyNot, fitted: bool) -> None:
    key = _key(row.strategy, fitted) if row.strategy is not None else ("rule", row.reason)
    if key in seen:
        same = seen[key]
        if same is not None and row.label not in same.label.split(" / "):
            same.label += f" / {row.label}"
        return  # the chosen plan itself, or a row already there
    seen[key] = row
    rows.append(row)


def _family_on_its_own(degrees: dict[str, int], fixed: dict[str, Any], facts: ModelFacts, cluster: ClusterSpec,
                       global_batch: int, efficiency: Efficiency, layers: int, supports, cache=None,
                       tp_realization: str | None = None) -> tuple[Strategy | None, int, str, str]:
    """The best strategy of a family the ranked completions hold none of: (strategy, batch, the
    --strategy keys it contradicts, the rule that excludes it at the asked batch).

    Priced without the --strategy keys that lay out the mesh (the family sets them), at the asked
    batch or else the nearest larger one that divides over one of its data-parallel degrees.
    """
    keys = {k: v for k, v in fixed.items()
            if k not in _LAYOUT_KEYS and not (k == "recompute_layers" and isinstance(v, tuple))}
    keys.update(degrees)
    world, pp, cp = cluster.world_size, degrees.get("pp", 1), degrees.get("cp", 1)
    tp_options = [degrees["tp"]] if "tp" in degrees else [t for t in range(1, world + 1) if world % t == 0]
    dp_options = {world // (t * pp * cp) for t in tp_options if world % (t * pp * cp) == 0}
    larger = sorted({math.ceil(global_batch / dp) * dp for dp in dp_options} - {global_batch})
    rule = ""
    for batch in [global_batch] + larger[:2]:
        try:
            quick, _, _ = quick_evaluations(facts, cluster, keys, batch, layers=layers, efficiency=efficiency,
                                            supports=supports, cache=cache, tp_realization=tp_realization)
        except AutoparError:
            rule = rule or _commonest_rule(keys, facts, cluster, batch, layers, supports)
            continue
        choice = _best_of(quick).strategy
        dropped = ",".join(f"{k}={v}" for k, v in fixed.items() if k in _LAYOUT_KEYS and getattr(choice, k) != v)
        return choice, batch, dropped, rule
    return None, global_batch, "", rule


def _commonest_rule(keys: dict[str, Any], facts: ModelFacts, cluster: ClusterSpec, batch: int, layers: int,
                    supports) -> str:
    """The rule most completions of `keys` break at `batch` (the search's own checks, in its words)."""
    broken: dict[str, int] = {}
    dp = None
    for strategy in completions(keys, cluster.world_size, batch, fewest_experts(facts.experts), facts.seq_len):
        dp = strategy.dp
        reason = supports(strategy) if supports is not None else None
        if reason is None:
            try:
                check_strategy(strategy, world_size=cluster.world_size, global_batch=batch, layers=layers,
                               heads=facts.heads, kv_heads=facts.kv_heads, experts=fewest_experts(facts.experts),
                               seq_len=facts.seq_len,
                               end_units=standalone_ends(facts.units))
            except AutoparError as error:
                reason = str(error)
        if reason is not None:
            broken[reason] = broken.get(reason, 0) + 1
    if broken:
        return max(broken.items(), key=lambda item: item[1])[0]
    tp, pp = keys.get("tp"), keys.get("pp", 1)
    ranks = f"its {cluster.world_size // (tp * pp)} data-parallel ranks" if tp else "its data-parallel ranks"
    return f"global batch {batch} does not divide over {ranks}" if dp is None else "no valid completion"


def critical_rank(evaluation: Evaluation) -> int:
    """The pipeline rank whose end sets the step time (the breakdown is that rank's): among the
    ranks whose idle time equals the breakdown's bubble, the one that finishes its passes last."""
    pipe = evaluation.pipeline
    if pipe is None or len(pipe.rank_end_s) <= 1:
        return 0
    bubble = evaluation.breakdown.get("bubble", 0.0)
    ranks = range(len(pipe.rank_end_s))
    matching = [r for r in ranks
                if abs(max(pipe.rank_end_s[r] - pipe.rank_busy_s[r], 0.0) - bubble) <= 1e-9 * max(1.0, bubble)]
    return max(matching or ranks, key=lambda r: pipe.rank_end_s[r])


def exposed_sync_s(evaluation: Evaluation) -> float:
    """The critical rank's communication after its last backward (data-parallel gradient sync and
    ZeRO weight gathers that nothing hides): the step's end less its passes and optimizer step."""
    pipe = evaluation.pipeline
    if pipe is None:
        return 0.0
    end = pipe.rank_end_s[critical_rank(evaluation)]
    return max(evaluation.step_time_s - end - evaluation.breakdown.get("optimizer", 0.0), 0.0)


def step_parts(evaluation: Evaluation) -> dict[str, float]:
    """The critical rank's step in parts, exposed communication split into what sits inside the
    passes (tensor-parallel collectives, ZeRO-3 gathers) and the sync after the last backward."""
    b = evaluation.breakdown
    sync = min(exposed_sync_s(evaluation), b.get("exposed_communication", 0.0))
    return {"compute": b.get("compute", 0.0), "recompute": b.get("recompute", 0.0),
            "in_passes": b.get("exposed_communication", 0.0) - sync, "sync": sync,
            "bubble": b.get("bubble", 0.0), "optimizer": b.get("optimizer", 0.0),
            "context_exchange": b.get("context_exchange", 0.0)}


def part_label(part: str, strategy: Strategy) -> str:
    """What a part of `step_parts` is, in the strategy's own terms."""
    if part == "sync":
        if strategy.dp > 1 and strategy.zero == 0:
            return "exposed gradient all-reduce"
        if strategy.dp > 1 and strategy.zero in (1, 2):
            return "exposed gradient reduce-scatter and weight all-gather"
        return "exposed gradient sync"
    if part == "in_passes":
        kinds = (["tensor-parallel collectives"] if strategy.tp > 1 else []) + \
                (["ZeRO-3 weight gathers"] if strategy.zero >= 3 and strategy.dp > 1 else [])
        return "exposed " + (" and ".join(kinds) or "communication inside the passes")
    return {"bubble": "pipeline bubble", "optimizer": "optimizer step",
            "context_exchange": f"exposed context-parallel exchange (cp={strategy.cp} {strategy.cp_kind})"
            }.get(part, part)


def seconds_text(seconds: float) -> str:
    if seconds < 5e-7:
        return "none" if seconds < 1e-9 else "<1 µs"
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def priced_row(label: str, evaluation: Evaluation, reference: Evaluation, *, without: str = "",
            batch_rule: str = "") -> WhyNot:
    """A row for `evaluation` against the chosen plan, per token (the same as per step at one batch).
    `without`: the --strategy keys it was priced without; `batch_rule`: why it was priced at
    another global batch than the one asked."""
    s = evaluation.strategy
    slowdown = reference.tokens_per_s / evaluation.tokens_per_s
    other_batch = evaluation.global_batch != reference.global_batch
    unit = " per token" if other_batch else ""
    if not evaluation.fits and not evaluation.fits_host:
        reason = (f"needs {evaluation.host_memory_bytes / GiB:.1f} GiB of host memory per node > "
                  f"{evaluation.host_capacity_bytes / GiB:.1f} GiB usable (optimizer states offloaded)"
                  + (f"; {slowdown:.2f}× slower{unit} even if it fit" if slowdown >= SAME_SPEED else ""))
    elif not evaluation.fits:
        worst = max(evaluation.memory, key=lambda m: m.total_bytes)
        part, size = max(worst.as_dict().items(), key=lambda item: item[1])
        reason = (f"needs {evaluation.peak_memory_bytes / GiB:.1f} GiB per GPU > {evaluation.capacity_bytes / GiB:.1f}"
                  f" GiB usable ({part.replace('_', ' ')} {size / GiB:.1f} GiB)"
                  + (f"; {slowdown:.2f}× slower{unit} even if it fit" if slowdown >= SAME_SPEED else ""))
    elif slowdown >= SAME_SPEED:
        mine, theirs = step_parts(evaluation), step_parts(reference)
        scale = reference.global_batch / evaluation.global_batch  # per token: its step holds more or fewer
        part, growth = max(((k, mine[k] * scale - theirs[k]) for k in mine), key=lambda item: item[1])
        reason = f"{slowdown:.2f}× slower{unit}"
        if growth > 0:
            reason += (f", {part_label(part, s)} {seconds_text(mine[part])}{' per step' if other_batch else ''} "
                       f"(chosen plan: {seconds_text(theirs[part])})")
    elif slowdown > 1 / SAME_SPEED:
        reason = f"as fast{unit} (within 0.5%)"
    elif other_batch or without:  # faster, but not at the batch asked or not under the keys given
        reason = f"{1 / slowdown:.2f}× faster{unit}" + (f" (try --global-batch {evaluation.global_batch})"
                                                        if other_batch and not without else "")
    else:
        reason = f"{1 / slowdown:.2f}× faster by this estimate, yet ranked below the chosen plan by the quick one"
    if other_batch:
        reason = f"{batch_rule}; at global batch {evaluation.global_batch}: {reason}"
    if without:
        reason = f"excluded by --strategy {without}; without it: {reason}"
    return WhyNot(label, s, reason, slowdown=slowdown, fits=evaluation.fits,
                  peak_memory_bytes=evaluation.peak_memory_bytes,
                  global_batch=evaluation.global_batch if other_batch else None)
