"""`autopar plan --report plan.html`: the report model as one self-contained HTML page.

Inline CSS and SVG only (no CDN, no fetch), so the file opens offline and can be attached to an
issue. It says what the terminal report says (rows per pipeline rank, why-not reasons, what MFU is
relative to: `autopar.report.views`), with drawings. A measured section (predicted against
measured, `autopar.report.compare`) can be added at render time or appended later.
"""

from __future__ import annotations

import re
from html import escape
from pathlib import Path

from autopar.errors import AutoparError
from autopar.io import atomic_write_text
from autopar.plan_schema import Strategy, parse_placements
from autopar.report.compare import ComparisonRow
from autopar.report.model import MEMORY_PARTS, Report
from autopar.report.svg import breakdown_svg, group_rows, memory_svg, mesh_svg, timeline_svg
from autopar.report.timeline import idle_s, makespan_s, timeline
from autopar.report.views import placement_text
from autopar.report.views import (GiB, checkpoint_lines, compact_units, context_text, counts_text, format_value,
                                  mfu_label, mfu_text, obvious_rows, offload_text, rank_rows, recompute_text,
                                  runner_up_reasons)

STRATEGY_KEYS = ("dp", "tp", "pp", "sp", "zero", "recompute", "recompute_layers", "microbatch", "num_microbatches",
                 "schedule", "vp", "ep", "cp", "cp_kind")
MEASURED_START, MEASURED_END = "<!-- measured:start -->", "<!-- measured:end -->"
SECTION_IDS = ("summary", "mesh", "stages", "timeline", "memory", "breakdown", "alternatives", "sharding")

_CSS = """
body{font-family:system-ui,sans-serif;margin:0;background:#fafafa;color:#222}
header{background:#1f2d3d;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
main{padding:8px 24px 24px}section{background:#fff;border:1px solid #ddd;border-radius:6px;margin:14px 0;
padding:10px 16px;overflow-x:auto}h2{font-size:16px;margin:4px 0 8px}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:3px 7px;text-align:left;
vertical-align:top}th{background:#f0f0f0}td.num{text-align:right;font-variant-numeric:tabular-nums}
.kpis{display:flex;flex-wrap:wrap;gap:10px}.kpi{background:#f0f4f8;border-radius:6px;padding:6px 12px}
.kpi b{display:block;font-size:17px}.bad{color:#b00020;font-weight:bold}.note{color:#555;font-size:12px}
.chosen{background:#eef6ee}code{font-size:11px}
"""


def _table(headers: list[str], rows: list[list[str]], ident: str = "", numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    number = ' class="num"'
    body = "".join("<tr>" + "".join(f'<td{number if i in numeric else ""}>{cell}</td>'
                                    for i, cell in enumerate(row)) + "</tr>" for row in rows)
    attribute = f' id="{ident}"' if ident else ""
    return f'<table{attribute}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _value(strategy: Strategy, key: str) -> str:
    value = getattr(strategy, key)
    return counts_text(value) if key == "recompute_layers" and value is not None else str(value)


def _label(strategy: Strategy) -> str:
    label = " ".join(f"{k}={_value(strategy, k)}" for k in _keys([strategy]) if getattr(strategy, k) is not None)
    return (label + (f" offload={strategy.offload}" if strategy.offload != "none" else "")
            + (" compile=true" if strategy.compile else ""))


def _keys(strategies: list[Strategy]) -> list[str]:
    """The strategy keys to show: cp and its kind only when some strategy splits sequences."""
    context = any(s.cp > 1 for s in strategies)
    return [k for k in STRATEGY_KEYS if context or k not in ("cp", "cp_kind")]


def _context_paragraph(report: Report) -> str:
    return (f'<p id="context-cost">context parallel: {escape(context_text(report))}</p>' if report.strategy.cp > 1
            else "")


def _summary_section(report: Report) -> str:
    p, c = report.predicted, report.cluster
    kpis = [("step time", format_value(p.step_time_s, "s")), ("throughput", f"{p.tokens_per_s:,.0f} tokens/s"),
            ("per GPU", f"{p.tflops_per_gpu:.1f} TFLOP/s"), (mfu_label(report), f"{p.mfu:.1%}"),
            ("peak memory", f"{p.peak_memory_bytes / GiB:.1f} / {report.capacity_bytes / GiB:.1f} GiB")]
    if p.host_capacity_bytes:
        kpis.append(("host memory per node", f"{p.host_memory_bytes / GiB:.1f} / {p.host_capacity_bytes / GiB:.1f} GiB"))
    cards = "".join(f'<div class="kpi">{escape(k)}<b>{escape(v)}</b></div>' for k, v in kpis)
    fits = "" if report.fits else '<p class="bad">DOES NOT FIT in device memory</p>'
    search = report.search
    return (f'<p>model <b>{escape(report.model)}</b>, global batch {report.global_batch} × seq '
            f'{report.seq_len} on {escape(c.name)}: {c.num_nodes} node(s) × {c.gpus_per_node} '
            f'{escape(c.gpu)} = {c.world_size} GPUs</p><p>strategy <code>{escape(_label(report.strategy))}</code>'
            + (f' (fixed: {escape(", ".join(report.fixed))})' if report.fixed else "")
            + f'</p><div class="kpis">{cards}</div>{fits}'
            + (f'<p id="offload-cost">offload: {escape(offload_text(report))}</p>' if report.strategy.offload != "none"
               else "") + _context_paragraph(report)
            + f'<p class="note" id="mfu-note">{escape(mfu_text(report.mfu_basis))}</p>'
            + (f'<p class="note">searched {search.candidates:,} strategies in {search.seconds:.1f} s</p>'
               if search else "") + _checkpoint_rows(report))


def _checkpoint_rows(report: Report) -> str:
    if report.checkpoint is None:
        return ""
    lines = [escape(line) for line in checkpoint_lines(report.checkpoint, report.cluster.world_size) if line]
    return '<p id="checkpoint-cost">checkpoint: ' + "<br>".join(lines) + "</p>"


def _mesh_section(report: Report) -> str:
    rows = [[escape(cell) for cell in row] for row in group_rows(report)]
    return (_table(["axis", "group size", "groups", "ranks of the first group", "where", "link"], rows, "mesh-groups")
            + f'<p class="note">Ranks are laid out ({", ".join(report.mesh.order)}) row-major, tp innermost, as the '
              'runtime builds its mesh.</p>'
            + mesh_svg(report))


def _stages_section(report: Report) -> str:
    """One row per pipeline rank, its virtual stages listed (as the terminal report)."""
    s = report.strategy
    per_rank = s.dp * s.cp * s.tp
    memory = report.predicted.peak_memory_bytes_per_stage
    rows = []
    for row in rank_rows(report):
        first = row.rank * per_rank
        rows.append([str(row.rank), f"{first}–{first + per_rank - 1}", " ".join(map(str, row.stage_indices)),
                     escape(compact_units(row.units)), f"{row.forward_s * 1e3:.2f}", f"{row.backward_s * 1e3:.2f}",
                     f"{(row.forward_s + row.backward_s) * s.num_microbatches * 1e3:.1f}",
                     f"{memory[row.rank] / GiB:.1f}", escape(recompute_text(row, s))])
    placement = escape(placement_text(s, "runs on"))
    note = (f'<p class="note">{s.pp * s.vp} virtual stages, {s.vp} per pipeline rank ({placement}); times are one micro-batch on one GPU, summed over the rank\'s stages.</p>' if s.vp > 1 else "")
    return note + _table(["pp rank", "GPUs", "stages", "modules", "fwd ms", "bwd ms",
                          f"× {s.num_microbatches} micro-batches, ms", "peak GiB", "recomputed layers"], rows,
                         "stage-table", numeric={0, 4, 5, 6, 7})


def _timeline_section(report: Report) -> str:
    passes = timeline(report)
    s = report.strategy
    model_s = report.pipeline.makespan_s if report.pipeline is not None else None
    idle = idle_s(passes, s.pp)
    note = (f'{s.schedule} schedule, {s.num_microbatches} micro-batches'
            + (f", {s.vp} chunks per rank" if s.vp > 1 else "")
            + f"; pipeline makespan {makespan_s(passes) * 1e3:.1f} ms"
            + (f" (cost model: {model_s * 1e3:.1f} ms)" if model_s else "")
            + f"; idle per rank {min(idle) * 1e3:.1f}–{max(idle) * 1e3:.1f} ms. Each pass includes its tensor-parallel "
              "collectives; the transfer between stages shows as the gap before a pass on the next rank.")
    return f'<p class="note">{escape(note)}</p>' + timeline_svg(report, passes)


def _memory_section(report: Report) -> str:
    rows = [[str(rank)] + [f"{getattr(parts, k) / GiB:.2f}" for k in MEMORY_PARTS] + [f"{parts.total_bytes / GiB:.2f}"]
            for rank, parts in enumerate(report.predicted.memory_breakdown_bytes)]
    return memory_svg(report) + _table(["pp rank"] + [k.replace("_", " ") + " GiB" for k in MEMORY_PARTS]
                                       + ["total GiB"], rows, "memory-table", numeric=set(range(8)))


def _breakdown_section(report: Report) -> str:
    breakdown = report.predicted.breakdown
    total = breakdown.total_s or 1.0
    rows = [[escape(k.replace("_", " ")), format_value(v, "s"), f"{v / total:.1%}"] for k, v in breakdown.parts()]
    return (breakdown_svg(report) + _table(["part (critical pipeline rank)", "time", "share"], rows,
                                           "breakdown-table", numeric={1, 2}))


def _alternatives_section(report: Report) -> str:
    reasons = runner_up_reasons(report)
    columns = [("chosen", report)] + [(f"#{i + 2}", alt) for i, alt in enumerate(report.alternatives)]
    base = report.predicted.step_time_s
    rows = [[k] + [escape(_value(c.strategy, k)) for _, c in columns] for k in _keys([c.strategy for _, c in columns])]
    rows.append(["step time"] + [f"{format_value(c.predicted.step_time_s, 's')} "
                                 f"({c.predicted.step_time_s / base:.2f}×)" for _, c in columns])
    rows.append(["MFU"] + [f"{c.predicted.mfu:.1%}" for _, c in columns])
    rows.append(["peak memory"] + [f"{c.predicted.peak_memory_bytes / GiB:.1f} GiB" for _, c in columns])
    rows.append(["fits"] + [("yes" if c.fits else '<span class="bad">no</span>') for _, c in columns])
    rows.append(["why not"] + ["—"] + [escape(reasons.get(c.strategy, "")) for _, c in columns[1:]])
    html = _table([""] + [name for name, _ in columns], rows, "alternatives-table")
    others = obvious_rows(report)
    if others:
        html += "<h3>why not the obvious alternatives</h3>" + _table(
            ["alternative", "strategy", "why it loses"],
            [[escape(w.label), f'<code>{escape(_label(w.strategy))}</code>' if w.strategy else "—", escape(w.reason)]
             for w in others], "why-not-table")
    return html


def _placement_text(text: str, axes: list[str]) -> str:
    parts = parse_placements(text)
    return " ".join(f"{axis}:{kind}{'' if dim is None else f'({dim})'}" for axis, (kind, dim) in zip(axes, parts))


def _sharding_section(report: Report) -> str:
    if not report.sharding:
        return '<p class="note">no plan (nothing fits), so no parameter placements.</p>'
    body = []
    for row in report.sharding:
        params = "<br>".join(f"<code>{escape(name)}</code> {escape(_placement_text(text, row.axes))}"
                             for name, text in row.params.items())
        body.append([escape(row.modules), str(row.count), params])
    return ('<p class="note">S(d): split along tensor dimension d over that mesh axis; R: replicated. '
            'Repeated layers with the same placements share a row.</p>'
            + _table(["modules", "layers", "parameter: placement per mesh axis"], body, "sharding-table", {1}))


def measured_section(rows: list[ComparisonRow]) -> str:
    """The predicted-against-measured table, between markers so it can be replaced later."""
    body = [[escape(r.metric), format_value(r.predicted, r.unit), format_value(r.measured, r.unit),
             "n/a" if r.error_pct is None else f"{r.error_pct:+.1f}%"] for r in rows]
    return (f'{MEASURED_START}<section id="measured"><h2>Predicted vs measured</h2>'
            + _table(["metric", "predicted", "measured", "error"], body, "measured-table", {1, 2, 3})
            + f"</section>{MEASURED_END}")


_TITLES = {"summary": "Plan", "mesh": "Cluster and device mesh", "stages": "Pipeline ranks and their stages",
           "timeline": "Pipeline schedule (one step)", "memory": "Memory per device",
           "breakdown": "Step time breakdown", "alternatives": "Alternatives", "sharding": "Per-layer sharding"}
_BUILDERS = {"summary": _summary_section, "mesh": _mesh_section, "stages": _stages_section,
             "timeline": _timeline_section, "memory": _memory_section, "breakdown": _breakdown_section,
             "alternatives": _alternatives_section, "sharding": _sharding_section}


def render_html(report: Report, measured_rows: list[ComparisonRow] | None = None) -> str:
    """The whole page as one string."""
    sections = "".join(f'<section id="{ident}"><h2>{_TITLES[ident]}</h2>{_BUILDERS[ident](report)}</section>'
                       for ident in SECTION_IDS)
    measured = measured_section(measured_rows) if measured_rows else ""
    title = f"autopar plan: {report.model} on {report.cluster.world_size} GPUs"
    # The script marks the page rendered and records its height (screenshots size their window by it).
    script = ("<script>document.body.dataset.rendered='1';"
              "document.body.dataset.heightPx=String(document.documentElement.scrollHeight);</script>")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f'<style>{_CSS}</style></head><body><header><h1>{escape(title)}</h1></header><main id="report">'
            f'{sections}{measured}</main>{script}</body></html>\n')


def append_measured_section(html_path: str | Path, rows: list[ComparisonRow]) -> None:
    """Add (or replace) the predicted-against-measured section of a written report."""
    path = Path(html_path)
    if not path.is_file():
        raise AutoparError(f"report {path} not found; write it first with `autopar plan --report {path}`")
    text = path.read_text(encoding="utf-8")
    section = measured_section(rows)
    if MEASURED_START in text and MEASURED_END in text:
        text = re.sub(re.escape(MEASURED_START) + ".*?" + re.escape(MEASURED_END), lambda _: section, text,
                      count=1, flags=re.S)
    elif "</main>" in text:
        text = text.replace("</main>", section + "</main>", 1)
    else:
        raise AutoparError(f"{path} is not an autopar plan report (no <main>); re-write it with `autopar plan --report`")
    atomic_write_text(path, text)
