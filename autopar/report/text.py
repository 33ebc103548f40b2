"""The terminal report, written to read like a Megatron-LM user's launch log: the parallel layout in
the degrees and schedule terms such a user sets, one line per pipeline rank (not per virtual stage),
and every alternative with the number that makes it lose."""

from __future__ import annotations

from autopar.cost_models.strategy import STRATEGY_KEYS
from autopar.report.model import Report
from autopar.report.views import placement_text
from autopar.report.views import (GiB, checkpoint_lines, compact_units, mfu_label, mfu_text, obvious_rows,
                                  context_text, experts_text, offload_text, plural,
                                  rank_rows, recompute_text, runner_up_reasons, seconds_text, strategy_flag,
                                  strategy_label)

_SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "interleaved 1F1B"}


def render_text(report: Report) -> str:
    sections = [_header(report), _layout(report), _prediction(report), _breakdown(report), _ranks(report),
                _memory(report), _checkpoint(report), _runners_up(report), _why_not(report), _search(report)]
    return "\n\n".join(section for section in sections if section)


def _header(report: Report) -> str:
    c = report.cluster
    precision = f" ({report.precision})" if report.precision else ""
    seq = f" × seq {report.seq_len}" if report.seq_len else ""
    return (f"model {report.model}{precision}, global batch {report.global_batch}{seq}\n"
            f"cluster {c.name}: {plural(c.num_nodes, 'node')} × {c.gpus_per_node} {c.gpu} = {c.world_size} GPUs")


def _layout(report: Report) -> str:
    s = report.strategy
    group = "dp × cp" if s.cp > 1 else "dp"
    every_layer_recomputed = s.recompute != "none" and s.recompute_layers is None
    kept = (" (blocks keep sequence shards, gathered again in backward)"
            if s.sp_inputs == "regathered" and not every_layer_recomputed else "")
    extras = ([f"sequence parallel{kept}"] if s.sp else []) + ([f"zero={s.zero} ({_zero_text(s.zero)} over {group})"]
                                                         if s.zero else [])
    context = f" × cp={s.cp}" if s.cp > 1 else ""
    lines = [f"parallelism   tp={s.tp}{context} × pp={s.pp} × dp={s.dp} = {s.tp * s.cp * s.pp * s.dp} GPUs"
             + "".join(f", {e}" for e in extras)]
    schedule = _SCHEDULES.get(s.schedule, s.schedule) if s.pp > 1 else "no pipeline"
    chunks = f", {s.vp} virtual stages per pipeline rank" if s.vp > 1 else ""
    accumulate = " (gradient accumulation)" if s.pp == 1 and s.num_microbatches > 1 else ""
    lines.append(f"schedule      {schedule}{chunks}; {plural(s.num_microbatches, 'micro-batch', 'micro-batches')} "
                 f"of {plural(s.microbatch, 'sequence')} per step{accumulate}")
    if s.recompute != "none":
        done = sum(st.recomputed_layers for st in report.stages)
        total = sum(st.layers for st in report.stages) if all(st.layers is not None for st in report.stages) else None
        if s.recompute_layers is None:
            how = "every layer"
        else:
            how = f"{done} of {plural(total, 'layer')}" if total is not None else plural(done, "layer")
            how += " (the first ones of each stage; per rank below)"
        lines.append(f"recompute     {s.recompute}, {how}")
    if s.offload != "none":
        lines.append(f"offload       {offload_text(report)}")
    if s.ep > 1:
        lines.append(f"experts       {experts_text(report)}")
    if s.cp > 1:
        lines.append(f"context       {context_text(report)}")
    flag, note = strategy_flag(s, report.fixed)
    free = [key for key in STRATEGY_KEYS if key not in report.fixed]
    chosen = ("chosen by the cost model" if not report.fixed else f"fixed: {', '.join(report.fixed)}"
              + ("; the rest chosen by the cost model" if free else ""))
    lines.append(f"--strategy    {flag}   ({chosen})")
    if note:
        lines.append(f"              ({note})")
    return "\n".join(lines)


def _zero_text(stage: int) -> str:
    return {1: "optimizer states sharded", 2: "optimizer states and gradients sharded",
            3: "optimizer states, gradients and weights sharded"}[stage]


def _prediction(report: Report) -> str:
    p = report.predicted
    worst = max(range(len(p.peak_memory_bytes_per_stage)), key=lambda r: p.peak_memory_bytes_per_stage[r])
    where = f" (pipeline rank {worst})" if len(p.peak_memory_bytes_per_stage) > 1 else ""
    return "\n".join([
        f"step time        {seconds_text(p.step_time_s)}",
        f"throughput       {p.tokens_per_s:,.0f} tokens/s",
        f"per GPU          {p.tflops_per_gpu:.1f} TFLOP/s of model FLOPs, {mfu_label(report)} {p.mfu:.1%}",
        f"                 {mfu_text(report.mfu_basis)}",
        f"peak memory      {p.peak_memory_bytes / GiB:.1f} GiB of {report.capacity_bytes / GiB:.1f} GiB usable{where}"
        + (f", {p.memory_headroom_bytes / GiB:.1f} GiB more kept free (headroom)" if p.memory_headroom_bytes else "")
        + ("" if report.fits else "   ** DOES NOT FIT **"),
    ] + ([f"host memory      {p.host_memory_bytes / GiB:.1f} GiB of {p.host_capacity_bytes / GiB:.1f} GiB usable per "
          f"node (optimizer states offloaded)"] if p.host_capacity_bytes else []))


def _breakdown(report: Report) -> str:
    breakdown = report.predicted.breakdown
    critical = f" {report.pipeline.critical_rank}" if report.pipeline is not None and report.pipeline.pp > 1 else ""
    total = breakdown.total_s or 1.0
    return "\n".join([f"time breakdown (critical pipeline rank{critical})"] + [
        f"  {part.replace('_', ' '):<22} {seconds_text(seconds, total):>10}  {seconds / total:6.1%}"
        for part, seconds in breakdown.parts()])


def _ranks(report: Report) -> str:
    s = report.strategy
    rows = rank_rows(report)
    interleaved = s.vp > 1
    title = (f"pipeline ranks: {plural(s.pp, 'rank')}" + (f" × {s.vp} virtual stages ({placement_text(s)})"
                                                         if interleaved else "")
             + "; fwd/bwd: one micro-batch on one GPU" + (", summed over the rank's stages" if interleaved else ""))
    header = ["rank"] + (["stages"] if interleaved else []) + ["modules", "fwd ms", "bwd ms", "recompute"]
    table = [[str(row.rank)] + ([" ".join(map(str, row.stage_indices))] if interleaved else [])
             + [compact_units(row.units), f"{row.forward_s * 1e3:.2f}", f"{row.backward_s * 1e3:.2f}",
                recompute_text(row, s)] for row in rows]
    numeric = {0, len(header) - 3, len(header) - 2}
    return title + "\n" + _table(header, table, numeric)


def _table(header: list[str], rows: list[list[str]], numeric: set[int]) -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  " + "  ".join(cell.rjust(w) if i in numeric else cell.ljust(w)
                                for i, (cell, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header)] + [line(r) for r in rows])


def _memory(report: Report) -> str:
    lines = ["memory per GPU of each pipeline rank (GiB): params / grads / optimizer / activations / buffers"]
    for rank, parts in enumerate(report.predicted.memory_breakdown_bytes):
        lines.append(f"  rank {rank:<3} {parts.total_bytes / GiB:6.1f} = " + " / ".join(
            f"{getattr(parts, k) / GiB:.1f}" for k in ("parameters", "gradients", "optimizer_states", "activations",
                                                       "buffers")) + f" (+{parts.margin / GiB:.1f} margin)")
    return "\n".join(lines)


def _checkpoint(report: Report) -> str:
    if report.checkpoint is None:
        return ""
    lines = [line for line in checkpoint_lines(report.checkpoint, report.cluster.world_size) if line]
    return "checkpoint\n" + "\n".join(f"  {line}" for line in lines)


def _runners_up(report: Report) -> str:
    if not report.alternatives:
        return ""
    reasons = runner_up_reasons(report)
    lines = ["runners-up"]
    for alt in report.alternatives:
        ratio = alt.predicted.step_time_s / report.predicted.step_time_s
        reason = reasons.get(alt.strategy) or (f"{ratio:.2f}× step time" + ("" if alt.fits else ", does not fit"))
        lines.append(f"  {strategy_label(alt.strategy)}: {reason}")
    return "\n".join(lines)


def _why_not(report: Report) -> str:
    rows = obvious_rows(report)
    if not rows:
        return ""
    return "\n".join(["why not"] + [f"  {row.label}" + (f" [{strategy_label(row.strategy)}]" if row.strategy else "")
                                    + f": {row.reason}" for row in rows])


def _search(report: Report) -> str:
    search = report.search
    if search is None:
        return ""
    ilp = ""
    if search.ilp_variables:
        budgeted = (f", {plural(search.ilp_budgeted, 'solve')} under a layer's memory budget"
                    if search.ilp_budgeted else "")
        ilp = f" (ILP: {search.ilp_variables:,} variables, {search.ilp_solve_s:.1f} s{budgeted})"
    searched = f"searched {plural(search.candidates, 'strategy', 'strategies')} in {search.seconds:.1f} s{ilp}"
    if search.compile_choice is not None:
        searched += f", eager and compiled; {search.compile_choice.line}"
    return searched
