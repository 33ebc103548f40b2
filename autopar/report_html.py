"""`autopar plan --report plan.html`: the plan summary as one self-contained HTML page.

Inline CSS and SVG only (no CDN, no fetch), so the file opens offline and can be attached to an
issue. Built from the plan summary (`autopar.plan_report.plan_summary`), never from internal
objects, so the terminal, HTML and trace renderers cannot disagree. A measured section (predicted
against measured, `autopar.plan_report.compare`) can be added at render time or appended later.
"""

from __future__ import annotations

import re
from html import escape
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.io import atomic_write_text
from autopar.plan_schema import parse_placements
from autopar.plan_report import GiB, format_value
from autopar.report_svg import breakdown_svg, group_rows, memory_svg, mesh_svg, timeline_svg
from autopar.report_timeline import idle_s, makespan_s, timeline

STRATEGY_KEYS = ("dp", "tp", "pp", "sp", "zero", "recompute", "recompute_layers", "microbatch", "num_microbatches",
                 "schedule", "vp")
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


def _label(strategy: dict[str, Any]) -> str:
    return " ".join(f"{k}={'/'.join(map(str, strategy[k])) if k == 'recompute_layers' else strategy[k]}"
                    for k in STRATEGY_KEYS if strategy.get(k) is not None)


def _summary_section(summary: dict[str, Any]) -> str:
    p, c = summary["predicted"], summary["cluster"]
    kpis = [("step time", format_value(p["step_time_s"], "s")), ("throughput", f"{p['tokens_per_s']:,.0f} tokens/s"),
            ("per GPU", f"{p['tflops_per_gpu']:.1f} TFLOP/s"), ("MFU", f"{p['mfu']:.1%}"),
            ("peak memory", f"{p['peak_memory_bytes'] / GiB:.1f} / {summary['capacity_bytes'] / GiB:.1f} GiB")]
    cards = "".join(f'<div class="kpi">{escape(k)}<b>{escape(v)}</b></div>' for k, v in kpis)
    fixed = summary.get("fixed") or {}
    fits = "" if summary["fits"] else '<p class="bad">DOES NOT FIT in device memory</p>'
    search = summary.get("search") or {}
    return (f'<p>model <b>{escape(str(summary["model"]))}</b>, global batch {summary["global_batch"]} × seq '
            f'{summary["seq_len"]} on {escape(c["name"])}: {c["num_nodes"]} node(s) × {c["gpus_per_node"]} '
            f'{escape(c["gpu"])} = {c["world_size"]} GPUs</p><p>strategy <code>{escape(_label(summary["strategy"]))}</code>'
            + (f' (fixed: {escape(", ".join(fixed))})' if fixed else "") + f'</p><div class="kpis">{cards}</div>{fits}'
            + (f'<p class="note">searched {search.get("candidates", 0):,} strategies in {search.get("seconds", 0):.1f} s</p>'
               if search else ""))


def _mesh_section(summary: dict[str, Any]) -> str:
    rows = [[r["axis"], r["size"], r["groups"], escape(r["example"]), r["placement"], escape(r["link"])]
            for r in group_rows(summary)]
    return (_table(["axis", "group size", "groups", "ranks of the first group", "where", "link"], rows, "mesh-groups")
            + '<p class="note">Ranks are laid out (pp, dp, tp) row-major, tp innermost, as the runtime builds its mesh.</p>'
            + mesh_svg(summary))


FOLD_STAGES_OVER = 16  # longer pipelines fold runs of identical stages into one row


def _stage_rows(stages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Runs of consecutive stages with the same unit count and pass times (one run each when short)."""
    runs: list[list[dict[str, Any]]] = []
    for st in stages:
        last = runs[-1][-1] if runs else None
        if (len(stages) > FOLD_STAGES_OVER and last is not None and len(last["units"]) == len(st["units"])
                and abs(last["forward_s"] - st["forward_s"]) <= 1e-9 * max(st["forward_s"], 1e-12)
                and abs(last["backward_s"] - st["backward_s"]) <= 1e-9 * max(st["backward_s"], 1e-12)):
            runs[-1].append(st)
        else:
            runs.append([st])
    return runs


def _stages_section(summary: dict[str, Any]) -> str:
    s = summary["strategy"]
    per_rank = s["dp"] * s["tp"]
    memory = summary["predicted"]["peak_memory_bytes_per_stage"]
    rows = []
    for run in _stage_rows(summary["stages"]):
        first_st, last_st = run[0], run[-1]
        units = [u for st in run for u in st["units"]]
        shown = escape(units[0] + (f" … {units[-1]}" if len(units) > 1 else "")) if units else ""
        ranks = sorted({st["rank"] for st in run})
        if len(run) == 1:
            first = first_st["rank"] * per_rank
            label, rank_text, gpus = str(first_st["index"]), str(first_st["rank"]), f"{first}–{first + per_rank - 1}"
            peak = f"{memory[first_st['rank']] / GiB:.1f}"
        else:
            label = f"{first_st['index']}–{last_st['index']} ({len(run)})"
            rank_text = f"{ranks[0]}–{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
            gpus, peak = f"{per_rank} per rank", f"{min(memory[r] for r in ranks) / GiB:.1f}–{max(memory[r] for r in ranks) / GiB:.1f}"
        rows.append([label, rank_text, gpus, str(len(first_st["units"])) + (" each" if len(run) > 1 else ""), shown,
                     f"{first_st['forward_s'] * 1e3:.2f}", f"{first_st['backward_s'] * 1e3:.2f}",
                     f"{(first_st['forward_s'] + first_st['backward_s']) * s['num_microbatches'] * 1e3:.1f}", peak,
                     str(first_st.get("recomputed_layers", 0))])
    folded = len(rows) < len(summary["stages"])
    return ((f'<p class="note">{len(summary["stages"])} virtual stages; consecutive stages with the same layer count '
             f'and times share a row (stage i runs on pp rank i mod {s["pp"]}).</p>' if folded else "")
            + _table(["stage", "pp rank", "GPUs", "units", "modules", "fwd ms", "bwd ms",
                      f"× {s['num_microbatches']} micro-batches, ms", "rank peak GiB", "recomputed layers"], rows,
                     "stage-table", numeric={0, 1, 3, 5, 6, 7, 8, 9}))


def _timeline_section(summary: dict[str, Any]) -> str:
    passes = timeline(summary)
    s = summary["strategy"]
    model_s = (summary.get("pipeline") or {}).get("makespan_s")
    idle = idle_s(passes, s["pp"])
    note = (f'{s["schedule"]} schedule, {s["num_microbatches"]} micro-batches'
            + (f", {s['vp']} chunks per rank" if s["vp"] > 1 else "")
            + f"; pipeline makespan {makespan_s(passes) * 1e3:.1f} ms"
            + (f" (cost model: {model_s * 1e3:.1f} ms)" if model_s else "")
            + f"; idle per rank {min(idle) * 1e3:.1f}–{max(idle) * 1e3:.1f} ms. Each pass includes its tensor-parallel "
              "collectives; the transfer between stages shows as the gap before a pass on the next rank.")
    return f'<p class="note">{escape(note)}</p>' + timeline_svg(summary, passes)


def _memory_section(summary: dict[str, Any]) -> str:
    keys = ("parameters", "gradients", "optimizer_states", "activations", "buffers", "margin")
    rows = [[str(rank)] + [f"{parts.get(k, 0.0) / GiB:.2f}" for k in keys] + [f"{sum(parts.values()) / GiB:.2f}"]
            for rank, parts in enumerate(summary["predicted"]["memory_breakdown_bytes"])]
    return memory_svg(summary) + _table(["pp rank"] + [k.replace("_", " ") + " GiB" for k in keys] + ["total GiB"],
                                        rows, "memory-table", numeric=set(range(8)))


def _breakdown_section(summary: dict[str, Any]) -> str:
    breakdown = summary["predicted"]["breakdown"]
    total = sum(breakdown.values()) or 1.0
    rows = [[escape(k.replace("_", " ")), format_value(v, "s"), f"{v / total:.1%}"] for k, v in breakdown.items()]
    return (breakdown_svg(summary) + _table(["part (critical pipeline rank)", "time", "share"], rows,
                                            "breakdown-table", numeric={1, 2}))


def _alternatives_section(summary: dict[str, Any]) -> str:
    chosen = summary
    alternatives = summary.get("alternatives") or []
    why_not = summary.get("why_not") or []
    reasons = {_label(w["strategy"]): w["reason"] for w in why_not if w.get("strategy")}
    columns = [("chosen", chosen)] + [(f"#{i + 2}", alt) for i, alt in enumerate(alternatives)]
    base = chosen["predicted"]["step_time_s"]
    rows = [[k] + [escape(str(c["strategy"][k])) for _, c in columns] for k in STRATEGY_KEYS]
    rows.append(["step time"] + [f"{format_value(c['predicted']['step_time_s'], 's')} "
                                 f"({c['predicted']['step_time_s'] / base:.2f}×)" for _, c in columns])
    rows.append(["MFU"] + [f"{c['predicted']['mfu']:.1%}" for _, c in columns])
    rows.append(["peak memory"] + [f"{c['predicted']['peak_memory_bytes'] / GiB:.1f} GiB" for _, c in columns])
    rows.append(["fits"] + [("yes" if c["fits"] else '<span class="bad">no</span>') for _, c in columns])
    rows.append(["why not"] + ["—"] + [escape(reasons.get(_label(c["strategy"]), "")) for _, c in columns[1:]])
    html = _table([""] + [name for name, _ in columns], rows, "alternatives-table")
    others = [w for w in why_not if w.get("label") != "runner-up"]
    if others:
        html += "<h3>why not the obvious alternatives</h3>" + _table(
            ["alternative", "strategy", "reason"],
            [[escape(w["label"]), f'<code>{escape(_label(w["strategy"]))}</code>' if w.get("strategy") else "—",
              escape(w["reason"])] for w in others], "why-not-table")
    return html


def _placement_text(text: str, axes: list[str]) -> str:
    parts = parse_placements(text)
    return " ".join(f"{axis}:{kind}{'' if dim is None else f'({dim})'}" for axis, (kind, dim) in zip(axes, parts))


def _sharding_section(summary: dict[str, Any]) -> str:
    rows = summary.get("sharding")
    if not rows:
        return '<p class="note">no plan (nothing fits), so no parameter placements.</p>'
    body = []
    for row in rows:
        params = "<br>".join(f"<code>{escape(name)}</code> {escape(_placement_text(text, row['axes']))}"
                             for name, text in row["params"].items())
        body.append([escape(row["modules"]), str(row["count"]), params])
    return ('<p class="note">S(d): split along tensor dimension d over that mesh axis; R: replicated. '
            'Repeated layers with the same placements share a row.</p>'
            + _table(["modules", "layers", "parameter: placement per mesh axis"], body, "sharding-table", {1}))


def measured_section(rows: list[dict[str, Any]]) -> str:
    """The predicted-against-measured table, between markers so it can be replaced later."""
    body = [[escape(r["metric"]), format_value(r["predicted"], r["unit"]), format_value(r["measured"], r["unit"]),
             "n/a" if r["error_pct"] is None else f"{r['error_pct']:+.1f}%"] for r in rows]
    return (f'{MEASURED_START}<section id="measured"><h2>Predicted vs measured</h2>'
            + _table(["metric", "predicted", "measured", "error"], body, "measured-table", {1, 2, 3})
            + f"</section>{MEASURED_END}")


_TITLES = {"summary": "Plan", "mesh": "Cluster and device mesh", "stages": "Pipeline stages",
           "timeline": "Pipeline schedule (one step)", "memory": "Memory per device",
           "breakdown": "Step time breakdown", "alternatives": "Alternatives", "sharding": "Per-layer sharding"}


def render_html(summary: dict[str, Any], measured_rows: list[dict[str, Any]] | None = None) -> str:
    """The whole page as one string."""
    builders = {"summary": _summary_section, "mesh": _mesh_section, "stages": _stages_section,
                "timeline": _timeline_section, "memory": _memory_section, "breakdown": _breakdown_section,
                "alternatives": _alternatives_section, "sharding": _sharding_section}
    sections = "".join(f'<section id="{ident}"><h2>{_TITLES[ident]}</h2>{builders[ident](summary)}</section>'
                       for ident in SECTION_IDS)
    measured = measured_section(measured_rows) if measured_rows else ""
    title = f"autopar plan: {summary['model']} on {summary['cluster']['world_size']} GPUs"
    # The script marks the page rendered and records its height (screenshots size their window by it).
    script = ("<script>document.body.dataset.rendered='1';"
              "document.body.dataset.heightPx=String(document.documentElement.scrollHeight);</script>")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f'<style>{_CSS}</style></head><body><header><h1>{escape(title)}</h1></header><main id="report">'
            f'{sections}{measured}</main>{script}</body></html>\n')


def append_measured_section(html_path: str | Path, rows: list[dict[str, Any]]) -> None:
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
