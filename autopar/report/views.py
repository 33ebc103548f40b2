"""Views of the report model that the terminal and HTML renderers share, so they say the same thing:
per pipeline rank rows, strategy labels, compact module lists, plural-aware wording, what MFU means."""

from __future__ import annotations

import re
from dataclasses import dataclass

from autopar.plan_schema import Strategy
from autopar.report.model import CheckpointCost, MfuBasis, Report, StageRow, WhyNotRow

GiB = 2**30
LIST_COUNTS_UP_TO = 8  # longer per-stage recompute lists are summarised (the full list is in --json)
STRATEGY_KEYS = ("dp", "tp", "pp", "microbatch", "schedule", "vp", "zero", "recompute", "sp")


def plural(count: int, word: str, words: str | None = None) -> str:
    """`1 layer`, `2 layers`, `1,024 GPUs`."""
    return f"{count:,} {word if count == 1 else (words or word + 's')}"


def format_value(value: float, unit: str) -> str:
    if unit == "bytes":
        return f"{value / GiB:.2f} GiB"
    return f"{value * 1e3:.2f} ms" if value < 1.0 else f"{value:.3f} s"


def seconds_text(seconds: float, scale_s: float | None = None) -> str:
    """`5.346 s`, or `4.02 ms` when `scale_s` (default: the value itself) is under a second."""
    return f"{seconds:.3f} s" if (seconds if scale_s is None else scale_s) >= 1.0 else f"{seconds * 1e3:.2f} ms"


def counts_text(counts: list[int] | tuple[int, ...]) -> str:
    """Per-stage recompute counts as --strategy takes them: `2` when every stage has 2, `3/2/1/0`
    when short, else the first few and the total."""
    counts = list(counts)
    if counts and all(k == counts[0] for k in counts):
        return str(counts[0])
    if len(counts) <= LIST_COUNTS_UP_TO:
        return "/".join(map(str, counts))
    return "/".join(map(str, counts[:4])) + f"/… ({sum(counts)} layers over {len(counts)} stages)"


def strategy_label(strategy: Strategy) -> str:
    """One alternative on one line: `dp=64 tp=2 pp=8 microbatch=1 ... recompute_layers=2/1/…`."""
    label = " ".join(f"{k}={getattr(strategy, k)}" for k in STRATEGY_KEYS)
    if strategy.recompute_layers is not None:
        label += f" recompute_layers={counts_text(strategy.recompute_layers)}"
    if strategy.offload != "none":
        label += f" offload={strategy.offload}"
    if strategy.ep > 1:
        label += f" ep={strategy.ep}"
    if strategy.cp > 1:
        label += f" cp={strategy.cp} cp_kind={strategy.cp_kind}"
    if strategy.sp and strategy.sp_inputs != "gathered":
        label += f" sp_inputs={strategy.sp_inputs}"
    if strategy.compile:
        label += " compile=true"
    return label


def strategy_flag(strategy: Strategy, fixed: dict) -> tuple[str, str]:
    """The chosen strategy as `--strategy` takes it, and a note on what it leaves out (long recompute
    lists, which the planner fits again from the same keys)."""
    s = strategy
    keys = [f"dp={s.dp}", f"tp={s.tp}", f"pp={s.pp}", f"sp={str(s.sp).lower()}", f"zero={s.zero}",
            f"recompute={s.recompute}", f"microbatch={s.microbatch}", f"schedule={s.schedule}", f"vp={s.vp}"]
    note = ""
    counts = s.recompute_layers
    if counts is None and s.recompute != "none" and fixed.get("recompute_layers") == "all":
        keys.append("recompute_layers=all")
    elif counts is not None:
        text = counts_text(counts)
        if "…" in text:
            note = (f"its {len(counts)} per-stage recompute counts are in --json and the plan file; "
                    f"planning with these keys fits them again")
        else:
            keys.append(f"recompute_layers={text}")
    if s.offload != "none":
        keys.append(f"offload={s.offload}")
    if s.ep > 1:
        keys.append(f"ep={s.ep}")
    if s.cp > 1:
        keys += [f"cp={s.cp}", f"cp_kind={s.cp_kind}"]
    if s.sp and s.sp_inputs != "gathered":
        keys.append(f"sp_inputs={s.sp_inputs}")
    if s.compile:  # the plan is priced compiled: re-planned without the key it would be priced eager
        keys.append("compile=true")
    return ",".join(keys), note


def experts_text(report: Report) -> str:
    """What ep > 1 does and costs the chosen plan, in one line."""
    s, p = report.strategy, report.predicted
    seconds = p.breakdown.expert_all_to_all
    share = seconds / p.step_time_s if p.step_time_s else 0.0
    sharded = f", ZeRO-{s.zero} sharding their states over them" if s.zero else ""
    groups = "the dp ranks" if s.ep == s.dp else \
        f"groups of {s.ep} of the {s.dp} dp ranks ({s.dp // s.ep} replicas{sharded})"
    return (f"ep={s.ep}: each MoE layer's experts split over {groups}, tokens sent to them and back by "
            f"all-to-all: +{seconds_text(seconds)} per step not hidden ({share:.0%} of the step)")


def context_text(report: Report) -> str:
    """What cp > 1 does and costs the chosen plan, in one line."""
    s, p = report.strategy, report.predicted
    seconds = p.breakdown.context_exchange
    share = seconds / p.step_time_s if p.step_time_s else 0.0
    axis = report.mesh.axes.get("cp")
    link = f" over {axis.link}" if axis is not None and axis.link != "none" else ""
    if s.cp_kind == "ring":
        how = (f"each sequence cut into {2 * s.cp} chunks, rank r of {s.cp} holding chunks r and {2 * s.cp - 1}−r; "
               f"key/value blocks passed around the ring{link}, overlapped with attention")
    else:
        how = (f"each sequence cut into {s.cp} chunks; queries, keys, values and outputs re-sharded from sequence to "
               f"heads and back by all-to-all{link}")
    return (f"cp={s.cp} {s.cp_kind}: {how}: +{seconds_text(seconds)} per step not hidden ({share:.1%} of the step); "
            f"weights replicated over cp, gradients reduced over dp × cp = {s.dp * s.cp}")


def offload_text(report: Report) -> str:
    """What offload=optimizer costs the chosen plan, in one line."""
    p, b = report.predicted, report.predicted.breakdown
    share = (b.cpu_optimizer + b.offload_transfer) / p.step_time_s if p.step_time_s else 0.0
    return (f"optimizer states (fp32 master weights, Adam moments, reduced gradients) in host memory, stepped on "
            f"the CPU: +{seconds_text(b.cpu_optimizer)} CPU Adam and +{seconds_text(b.offload_transfer)} PCIe copies "
            f"not hidden per step ({share:.0%} of the step); host memory {p.host_memory_bytes / GiB:.1f} of "
            f"{p.host_capacity_bytes / GiB:.1f} GiB per node")


_NUMBERED = re.compile(r"^(.*)\.(\d+)$")


def compact_units(names: list[str]) -> str:
    """`pre, layers.0, layers.1, layers.16, layers.17, post` → `pre, layers.{0–1,16–17}, post`."""
    groups: list[tuple[str, list[int] | None]] = []
    for name in names:
        match = _NUMBERED.match(name)
        if match and groups and groups[-1][1] is not None and groups[-1][0] == match.group(1):
            groups[-1][1].append(int(match.group(2)))
        elif match:
            groups.append((match.group(1), [int(match.group(2))]))
        else:
            groups.append((name, None))
    parts = []
    for prefix, indices in groups:
        if indices is None:
            parts.append(prefix)
            continue
        spans = _spans(indices)
        parts.append(f"{prefix}.{spans[0]}" if len(spans) == 1 else f"{prefix}.{{{','.join(spans)}}}")
    return ", ".join(parts)


def _spans(indices: list[int]) -> list[str]:
    spans: list[list[int]] = []
    for index in indices:
        if spans and index == spans[-1][1] + 1:
            spans[-1][1] = index
        else:
            spans.append([index, index])
    return [str(a) if a == b else f"{a}–{b}" for a, b in spans]


@dataclass(frozen=True)
class RankRow:
    """One pipeline rank: its virtual stages and what one micro-batch costs on it."""

    rank: int
    stages: list[StageRow]

    @property
    def stage_indices(self) -> list[int]:
        return [st.index for st in self.stages]

    @property
    def units(self) -> list[str]:
        return [u for st in self.stages for u in st.units]

    @property
    def forward_s(self) -> float:
        return sum(st.forward_s for st in self.stages)

    @property
    def backward_s(self) -> float:
        return sum(st.backward_s for st in self.stages)

    @property
    def recomputed_layers(self) -> int:
        return sum(st.recomputed_layers for st in self.stages)

    @property
    def layers(self) -> int | None:
        counts = [st.layers for st in self.stages]
        return None if any(k is None for k in counts) else sum(counts)


def rank_rows(report: Report) -> list[RankRow]:
    """Stages grouped by the pipeline rank that runs them (stage i on rank i mod pp)."""
    by_rank: dict[int, list[StageRow]] = {}
    for st in sorted(report.stages, key=lambda st: st.index):
        by_rank.setdefault(st.rank, []).append(st)
    return [RankRow(rank, stages) for rank, stages in sorted(by_rank.items())]


def recompute_text(row: RankRow, strategy: Strategy) -> str:
    """`8 of 12 layers (2/2/1/1/1/1)`, `1 layer`, `none`, or `—` without recompute."""
    if strategy.recompute == "none":
        return "—"
    done = row.recomputed_layers
    if not done:
        return "none"
    text = f"{done} of {plural(row.layers, 'layer')}" if row.layers is not None else plural(done, "layer")
    if len(row.stages) > 1:
        text += f" ({'/'.join(str(st.recomputed_layers) for st in row.stages)})"
    return text


def mfu_text(basis: MfuBasis | None, *, flops: str = "model FLOP/s per GPU, recompute not counted",
             running_on: str | None = None) -> str:
    """What an MFU figure is relative to, in one sentence. `running_on`: the device type a run
    measured on when it is not the GPU the peak belongs to (the figure is then nominal too)."""
    if basis is None:
        return f"MFU = {flops}, over the GPU's dense peak"
    peak = f"{basis.peak_tflops:,.0f} TFLOP/s" if basis.peak_tflops >= 10 else f"{basis.peak_tflops:g} TFLOP/s"
    caveat = ": compare it only with other nominal figures"
    if basis.nominal:
        return (f"MFU (nominal) = {flops}, over a placeholder {basis.dtype} peak of {peak} for {basis.gpu}, "
                f"a device known only nominally ({basis.source}){caveat}")
    text = (f"MFU{' (nominal)' if running_on else ''} = {flops}, over the {basis.gpu}'s dense {basis.dtype} peak "
            f"of {peak} ({basis.source})")
    return text + (f", but this launch runs on {running_on}{caveat}" if running_on else "")


def mfu_label(report: Report) -> str:
    return "MFU (nominal)" if report.mfu_basis is not None and report.mfu_basis.nominal else "MFU"


def obvious_rows(report: Report) -> list[WhyNotRow]:
    """The why-not rows for the obvious alternatives (runners-up get their reasons beside them)."""
    return [row for row in report.why_not if row.label != "runner-up"]


def runner_up_reasons(report: Report) -> dict[Strategy, str]:
    return {row.strategy: row.reason for row in report.why_not if row.is_runner_up and row.strategy is not None}


def checkpoint_lines(cost: CheckpointCost, world_size: int) -> list[str]:
    """The checkpoint's predicted save time, how often to save, and what the prediction leaves out."""
    largest = max(cost.bytes_per_rank, default=0.0)
    return [
        f"save {seconds_text(cost.save_time_s)} predicted: {_decimal_bytes(cost.checkpoint_bytes)} in all "
        f"(fp32 weights and Adam moments), {_decimal_bytes(cost.busiest_node_bytes)} from the busiest node at "
        f"{cost.node_storage_write_bytes_per_s / 1e9:.3g} GB/s to storage, sha256 of {_decimal_bytes(largest)} per GPU "
        f"at {cost.hash_bytes_per_s / 1e9:.2f} GB/s (measured on the planning machine)",
        f"suggested --checkpoint-every {cost.checkpoint_every:,} (Young/Daly: every {cost.interval_s / 3600:,.2f} h of "
        f"compute; at Llama 3's failure rate, 419 interruptions in 54 days on 16,384 GPUs, {plural(world_size, 'GPU')} "
        f"fail once per {cost.mtbf_s / 3600:,.0f} h)",
        f"not priced: {cost.leaves_out}" if cost.leaves_out else "",
    ]


def _decimal_bytes(value: float) -> str:
    for scale, suffix in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if value >= scale:
            return f"{value / scale:.3g} {suffix}"
    return f"{value:.0f} B"


def placement_text(s, verb: str = "on") -> str:
    """Which pipeline rank runs which virtual stage (`plan_schema.stage_rank`), in words."""
    if s.schedule == "zbv":
        return f"a V: rank r runs stages r and {2 * s.pp - 1}-r"
    return f"stage i {verb} rank i mod {s.pp}"
