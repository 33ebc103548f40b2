"""Inline SVG drawings for the HTML plan report, from the report model.

Drawn compactly so a 1,024-GPU plan stays readable and small: a few nodes in detail (GPUs coloured
by tensor-parallel group), then every node as one cell coloured by pipeline rank; the schedule as
one path per rank and pass kind when there are too many passes to draw one by one.
"""

from __future__ import annotations

import math
import re
from html import escape

from autopar.cost_models.pipeline import Pass
from autopar.report.model import LinkInfo, Report
from autopar.report.views import GiB

PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac", "#86bcb6", "#d37295"]
MEMORY_COLOURS = {"parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer_states": "#e15759",
                  "activations": "#59a14f", "buffers": "#b07aa1", "margin": "#bab0ac"}
BREAKDOWN_COLOURS = {"compute": "#4e79a7", "recompute": "#edc948", "exposed_communication": "#e15759",
                     "bubble": "#bab0ac", "optimizer": "#b07aa1", "offload_transfer": "#f28e2b",
                     "cpu_optimizer": "#76b7b2", "expert_all_to_all": "#ff9da7", "context_exchange": "#9c755f"}
DETAIL_NODES = 2  # nodes drawn GPU by GPU; the rest are cells in the grid
RECT_LIMIT = 800  # passes drawn as separate rectangles (with tooltips) up to this many

PASS_NAMES = {"F": "forward", "W": "weight-gradient"}  # "B": backward (input gradient under zero bubble)


def _f(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


def _svg(width: float, height: float, body: list[str], ident: str) -> str:
    return (f'<svg id="{ident}" xmlns="http://www.w3.org/2000/svg" width="{_f(width)}" height="{_f(height)}" '
            f'viewBox="0 0 {_f(width)} {_f(height)}" font-family="sans-serif" font-size="11">' + "".join(body) + "</svg>")


def _bandwidth(link: LinkInfo | None) -> str:
    return "" if not link else f" ({link.bandwidth_bytes_per_s / 1e9:.0f} GB/s per GPU)"


def _span(ranks: list[int]) -> str:
    if len(ranks) > 1 and all(b - a == ranks[1] - ranks[0] for a, b in zip(ranks, ranks[1:])):
        step = ranks[1] - ranks[0]
        return f"{ranks[0]}–{ranks[-1]}" if step == 1 else f"{ranks[0]}, {ranks[1]}, … {ranks[-1]} (every {step})"
    return ", ".join(map(str, ranks))


def group_rows(report: Report) -> list[list[str]]:
    """One table row per mesh axis: axis, group size, count, an example group, where, link."""
    rows = []
    for axis in [a for a in ("tp", "cp", "dp", "pp") if a in report.mesh.axes]:
        info = report.mesh.axes[axis]
        where = "inside one node" if info.within_node else f"across {info.nodes_per_group} nodes"
        rows.append([axis, str(info.size), str(info.groups), _span(info.first_group), where, info.link])
    return rows


def mesh_svg(report: Report) -> str:
    """Detail of the first nodes (GPUs by tp group) and a grid of all nodes coloured by pp rank."""
    mesh = report.mesh
    per_node, nodes = mesh.gpus_per_node, mesh.num_nodes
    tp_stride = mesh.axes["tp"].size
    links = mesh.links
    body: list[str] = []
    gpu_w, gpu_h, pad = 58, 40, 8
    node_w = per_node * (gpu_w + 6) + 2 * pad
    detail = min(DETAIL_NODES, nodes)
    y = 6
    intra = links.intra_node
    body.append(f'<text x="4" y="{y + 10}" font-weight="bold">GPUs of the first {detail} node(s): colour = tensor-'
                f'parallel group; inside a node every GPU talks over '
                f'{escape(intra.name) if intra else "the node link"}'
                f'{_bandwidth(intra)}</text>')
    y += 20
    for node in range(detail):
        x0 = 4 + node * (node_w + 16)
        body.append(f'<rect x="{x0}" y="{y}" width="{node_w}" height="{gpu_h + 38}" rx="6" fill="#f5f5f5" '
                    f'stroke="#555"/><text x="{x0 + pad}" y="{y + 13}">node {node}</text>')
        for slot in range(per_node):
            rank = node * per_node + slot
            if rank >= mesh.world_size:
                break
            c = mesh.coordinates(rank)
            colour = PALETTE[(rank // tp_stride) % len(PALETTE)]
            gx = x0 + pad + slot * (gpu_w + 6)
            where = ", ".join(f"{axis} {c[axis]}" for axis in mesh.order)
            body.append(f'<g><title>GPU {rank}: {where}</title>'
                        f'<rect x="{gx}" y="{y + 20}" width="{gpu_w}" height="{gpu_h}" rx="4" fill="{colour}"/>'
                        f'<text x="{gx + gpu_w / 2}" y="{y + 35}" text-anchor="middle" fill="#fff" '
                        f'font-weight="bold">GPU {rank}</text><text x="{gx + gpu_w / 2}" y="{y + 50}" '
                        f'text-anchor="middle" fill="#fff" font-size="9">p{c["pp"]} d{c["dp"]} t{c["tp"]}</text></g>')
        body.append(f'<line x1="{x0 + pad}" y1="{y + gpu_h + 28}" x2="{x0 + node_w - pad}" y2="{y + gpu_h + 28}" '
                    f'stroke="#76b900" stroke-width="4"/>')
    y += gpu_h + 52
    pp = mesh.axes["pp"].size
    nodes_per_pp = max(1, mesh.axes["pp"].stride // per_node)
    columns = nodes_per_pp if nodes_per_pp <= 32 and nodes % nodes_per_pp == 0 else min(nodes, 16)
    cell = 22 if columns <= 24 else 14
    inter = links.inter_node
    body.append(f'<text x="4" y="{y + 10}" font-weight="bold">All {nodes} node(s), {columns} per row: colour = '
                f'pipeline rank; nodes talk over {escape(inter.name) if inter else "—"}'
                f'{_bandwidth(inter)}</text>')
    y += 18
    for node in range(nodes):
        row, col = divmod(node, columns)
        first = node * per_node
        ranks = sorted({mesh.coordinates(r)["pp"] for r in range(first, min(first + per_node, mesh.world_size))})
        colour = PALETTE[ranks[0] % len(PALETTE)]
        x, cy = 60 + col * (cell + 3), y + row * (cell + 3)
        body.append(f'<rect x="{x}" y="{cy}" width="{cell}" height="{cell}" rx="2" fill="{colour}"><title>node {node}: '
                    f'GPUs {first}–{first + per_node - 1}, pp rank {", ".join(map(str, ranks))}</title></rect>')
        if col == 0:
            body.append(f'<text x="4" y="{cy + cell / 2 + 4}">pp {ranks[0]}</text>' if columns == nodes_per_pp
                        else f'<text x="4" y="{cy + cell / 2 + 4}">n{node}</text>')
    rows = -(-nodes // columns)
    y += rows * (cell + 3) + 6
    dp_info = mesh.axes["dp"]
    if columns == nodes_per_pp and pp > 1:
        body.append(f'<text x="4" y="{y + 9}">one row = one pipeline rank ({nodes_per_pp} node(s)): its data-parallel '
                    f'groups ({dp_info.size} GPUs each) stay in the row; activations go down a column to the next '
                    f'rank</text>')
        y += 16
    legend_x = 4
    for rank in range(min(pp, len(PALETTE))):
        body.append(f'<rect x="{legend_x}" y="{y}" width="10" height="10" fill="{PALETTE[rank]}"/>'
                    f'<text x="{legend_x + 13}" y="{y + 9}">pp {rank}</text>')
        legend_x += 52
    captions = [len(re.sub(r"<[^>]+>", "", part)) for part in body if part.startswith('<text x="4"')]
    width = max(4 + detail * (node_w + 16), 70 + columns * (cell + 3), legend_x + 10,
                8 + max(captions, default=0) * 6.5)  # about 6.5 px per character at 11 px
    return _svg(width, y + 18, body, "mesh-svg")


def _ticks(total_s: float, width: float, x0: float, y: float) -> list[str]:
    """About eight ticks at 1-2-5 multiples of a power of ten."""
    raw = total_s / 8
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    out, k = [], 0
    while k * step <= total_s * 1.0001:
        t = k * step
        x = x0 + t / total_s * width
        label = f"{t * 1e3:.{max(0, -math.floor(math.log10(step * 1e3)))}f} ms" if total_s < 2 else f"{t:g} s"
        out.append(f'<line x1="{_f(x)}" y1="{y}" x2="{_f(x)}" y2="{y + 4}" stroke="#333"/>'
                   f'<text x="{_f(x)}" y="{y + 15}" text-anchor="middle">{label}</text>')
        k += 1
    return out


def timeline_svg(report: Report, passes: list[Pass]) -> str:
    """Forward/backward passes per pp rank against time; bubbles show as the red-tinted background."""
    pipeline = getattr(report, "pipeline", None)
    pp, vp = report.strategy.pp, report.strategy.vp
    sync = pipeline.exposed_sync_s if pipeline is not None else [0.0] * pp
    optimizer = pipeline.optimizer_s if pipeline is not None else [0.0] * pp
    offload = (pipeline.offload_transfer_s if pipeline is not None else []) or [0.0] * pp
    offloaded = report.strategy.offload != "none"
    step_colour, step_label = (("cpu_optimizer", "CPU optimizer step") if offloaded else ("optimizer", "optimizer"))
    ends = [0.0] * pp
    for x in passes:
        ends[x.rank] = max(ends[x.rank], x.end_s)
    total = max(max(e + s + c + o for e, s, c, o in zip(ends, sync, offload, optimizer)), 1e-12)
    x0, width, row_h = 70, 1000, 18 if pp <= 32 else 8
    scale = width / total
    body: list[str] = []
    for rank in range(pp):
        y = 4 + rank * (row_h + 4)
        body.append(f'<text x="4" y="{y + row_h - 5}">pp {rank}</text><rect x="{x0}" y="{y}" width="{_f(ends[rank] * scale)}" '
                    f'height="{row_h}" fill="#f8d7d3"/>')
        tail = ends[rank]
        for seconds, colour, label in ((sync[rank], BREAKDOWN_COLOURS["exposed_communication"], "gradient sync"),
                                       (offload[rank], BREAKDOWN_COLOURS["offload_transfer"], "PCIe offload copies"),
                                       (optimizer[rank], BREAKDOWN_COLOURS[step_colour], step_label)):
            if seconds > 0:
                body.append(f'<rect x="{_f(x0 + tail * scale)}" y="{y}" width="{_f(max(seconds * scale, 1))}" '
                            f'height="{row_h}" fill="{colour}"><title>{label}: {seconds * 1e3:.1f} ms</title></rect>')
                tail += seconds
    shades = {"F": ["#9ecae1", "#6baed6", "#4292c6", "#2171b5"], "B": ["#fdae6b", "#fd8d3c", "#f16913", "#d94801"],
              "W": ["#a1d99b", "#74c476", "#41ab5d", "#238b45"]}  # zero-bubble schedules' weight-gradient passes
    if len(passes) <= RECT_LIMIT:
        for x in passes:
            y = 4 + x.rank * (row_h + 4)
            w = (x.end_s - x.start_s) * scale
            fill = shades[x.kind][(x.stage // pp) % 4]
            body.append(f'<g><title>{x.kind}{x.microbatch} stage {x.stage}: {x.start_s * 1e3:.2f}–{x.end_s * 1e3:.2f} ms'
                        f'</title><rect x="{_f(x0 + x.start_s * scale)}" y="{y}" width="{_f(w)}" height="{row_h}" '
                        f'fill="{fill}" stroke="#fff" stroke-width="0.5"/>'
                        + (f'<text x="{_f(x0 + x.start_s * scale + w / 2)}" y="{y + row_h - 5}" text-anchor="middle" '
                           f'font-size="9">{x.microbatch}</text>' if w > 14 else "") + "</g>")
    else:  # one path per (rank, kind, chunk): a few kilobytes per rank instead of one element per pass
        paths: dict[tuple[int, str, int], list[str]] = {}
        for x in passes:
            y = 4 + x.rank * (row_h + 4)
            w = max((x.end_s - x.start_s) * scale, 0.3)
            paths.setdefault((x.rank, x.kind, x.stage // pp), []).append(
                f'M{_f(x0 + x.start_s * scale)} {y}h{w:.2f}v{row_h}h-{w:.2f}z')
        for (rank, kind, chunk), parts in sorted(paths.items()):
            body.append(f'<path d="{"".join(parts)}" fill="{shades[kind][chunk % 4]}" stroke="#fff" stroke-width="0.3">'
                        f'<title>pp {rank}: {PASS_NAMES.get(kind, "backward")} passes of chunk {chunk}</title></path>')
    axis_y = 4 + pp * (row_h + 4) + 2
    body += _ticks(total, width, x0, axis_y)
    legend_y = axis_y + 24
    legend = [("forward", shades["F"][0]), ("backward", shades["B"][0]), ("idle (bubble)", "#f8d7d3"),
              ("exposed gradient sync", BREAKDOWN_COLOURS["exposed_communication"])] \
        + ([("PCIe offload copies (exposed)", BREAKDOWN_COLOURS["offload_transfer"])] if offloaded else []) \
        + [(step_label, BREAKDOWN_COLOURS[step_colour])]
    lx = x0
    for label, colour in legend:
        body.append(f'<rect x="{lx}" y="{legend_y}" width="10" height="10" fill="{colour}"/>'
                    f'<text x="{lx + 13}" y="{legend_y + 9}">{label}</text>')
        lx += 14 + 7 * len(label) + 12
    if vp > 1:
        body.append(f'<text x="{lx}" y="{legend_y + 9}">darker = later chunk of {vp}</text>')
    return _svg(x0 + width + 20, legend_y + 16, body, "timeline-svg")


def memory_svg(report: Report) -> str:
    """Per pp rank: memory parts stacked against the usable capacity (dashed line)."""
    parts_per_rank = report.predicted.memory_breakdown_bytes
    capacity = report.capacity_bytes
    top = max([capacity] + [p.total_bytes for p in parts_per_rank]) * 1.05
    x0, width, row_h = 70, 800, 16
    scale = width / top
    body: list[str] = []
    for rank, parts in enumerate(parts_per_rank):
        y = 4 + rank * (row_h + 4)
        body.append(f'<text x="4" y="{y + row_h - 4}">pp {rank}</text>')
        x = x0
        for key, colour in MEMORY_COLOURS.items():
            value = getattr(parts, key)
            body.append(f'<rect x="{_f(x)}" y="{y}" width="{_f(value * scale)}" height="{row_h}" fill="{colour}">'
                        f'<title>{key}: {value / GiB:.2f} GiB</title></rect>')
            x += value * scale
        body.append(f'<text x="{_f(x + 4)}" y="{y + row_h - 4}">{parts.total_bytes / GiB:.1f} GiB</text>')
    bottom = 4 + len(parts_per_rank) * (row_h + 4)
    cx = x0 + capacity * scale
    body.append(f'<line x1="{_f(cx)}" y1="0" x2="{_f(cx)}" y2="{bottom}" stroke="#000" stroke-dasharray="4 3"/>'
                f'<text x="{_f(cx)}" y="{bottom + 12}" text-anchor="middle">usable {capacity / GiB:.1f} GiB</text>')
    lx, ly = x0, bottom + 22
    for key, colour in MEMORY_COLOURS.items():
        body.append(f'<rect x="{lx}" y="{ly}" width="10" height="10" fill="{colour}"/><text x="{lx + 13}" '
                    f'y="{ly + 9}">{key.replace("_", " ")}</text>')
        lx += 20 + 7 * len(key)
    return _svg(max(x0 + width + 80, lx), ly + 16, body, "memory-svg")


def breakdown_svg(report: Report) -> str:
    """The critical rank's step time as one stacked bar."""
    breakdown = report.predicted.breakdown
    total = breakdown.total_s or 1.0
    width = 900
    body, x = [], 4.0
    for key, seconds in breakdown.parts():
        w = seconds / total * width
        colour = BREAKDOWN_COLOURS.get(key, PALETTE[len(body) % len(PALETTE)])
        body.append(f'<rect x="{_f(x)}" y="4" width="{_f(w)}" height="24" fill="{colour}"><title>{escape(key)}: '
                    f'{seconds:.3f} s</title></rect>')
        if w > 60:
            body.append(f'<text x="{_f(x + 4)}" y="20" fill="#fff">{escape(key.replace("_", " "))}</text>')
        x += w
    return _svg(width + 8, 32, body, "breakdown-svg")
