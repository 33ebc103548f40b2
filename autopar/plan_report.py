"""What `autopar plan` reports: the chosen strategy, its prediction, stages, runners-up and why-not rows.

One report model (`plan_summary`, plain data: the `--json` output) and its renderers: the terminal
(`render`, here), HTML (`autopar.report_html`) and a Chrome/Perfetto trace (`autopar.report_trace`).
Renderers read only this plain data, so a saved `--json` file can be rendered again later.
`compare` adds measured figures next to the predicted ones (`render_comparison` for the terminal).
"""

from __future__ import annotations

import re
from typing import Any

from autopar.cost_models.evaluate import Evaluation

GiB = 2**30


def strategy_dict(evaluation: Evaluation) -> dict[str, Any]:
    s = evaluation.strategy
    return {"dp": s.dp, "tp": s.tp, "pp": s.pp, "sp": s.sp, "zero": s.zero, "recompute": s.recompute,
            "recompute_layers": None if s.recompute_layers is None else list(s.recompute_layers),
            "microbatch": s.microbatch, "num_microbatches": s.num_microbatches, "schedule": s.schedule, "vp": s.vp}


def layers_text(counts) -> str:
    """Per-stage recompute counts as users write them in --strategy: 3/3/2/1."""
    return "/".join(str(k) for k in counts)


def strategy_label(strategy: dict[str, Any]) -> str:
    keys = ("dp", "tp", "pp", "microbatch", "schedule", "vp", "zero", "recompute", "sp")
    label = " ".join(f"{k}={strategy[k]}" for k in keys)
    if strategy.get("recompute_layers") is not None:
        label += f" recompute_layers={layers_text(strategy['recompute_layers'])}"
    return label


def evaluation_summary(evaluation: Evaluation) -> dict[str, Any]:
    return {
        "strategy": strategy_dict(evaluation),
        "fits": evaluation.fits,
        "predicted": {
            "step_time_s": evaluation.step_time_s,
            "tokens_per_s": evaluation.tokens_per_s,
            "tflops_per_gpu": evaluation.tflops_per_gpu,
            "mfu": evaluation.mfu,
            "peak_memory_bytes": evaluation.peak_memory_bytes,
            "peak_memory_bytes_per_stage": [m.total_bytes for m in evaluation.memory],
            "memory_breakdown_bytes": [m.as_dict() for m in evaluation.memory],
            "memory_headroom_bytes": evaluation.headroom_bytes,  # left free beyond capacity_bytes
            "breakdown": evaluation.breakdown,
            "compute_s_per_stage": list(evaluation.rank_compute_s),
        },
        "stages": [
            {"index": stage.index, "rank": stage.rank, "units": list(stage.units),
             "forward_s": stage.forward_s, "backward_s": stage.backward_s, "recomputed_layers": stage.recomputed_layers}
            for stage in evaluation.stages
        ],
    }


def plan_summary(result: Any, *, model: str, cluster: Any, global_batch: int, seq_len: int,
                 fixed: dict[str, Any], plan: Any = None) -> dict[str, Any]:
    """`result`: a searcher.search.SearchResult."""
    chosen = result.best or result.ranked[0]
    summary = evaluation_summary(chosen.evaluation)
    summary.update({
        "model": model,
        "cluster": {"name": cluster.name, "gpu": cluster.gpu.name, "world_size": cluster.world_size,
                    "gpus_per_node": cluster.gpus_per_node, "num_nodes": cluster.num_nodes},
        "global_batch": global_batch,
        "seq_len": seq_len,
        "fixed": fixed,
        "capacity_bytes": chosen.evaluation.capacity_bytes,
        "search": {"candidates": result.candidates, "seconds": round(result.search_s, 3),
                   "ilp_variables": result.ilp_variables, "ilp_solve_s": round(result.ilp_solve_s, 3),
                   "ilp_budgeted": result.ilp_budgeted,
                   "rejected": result.rejected},
        "alternatives": [evaluation_summary(c.evaluation) for c in result.ranked if c is not chosen],
        "why_not": [{"label": w.label, "strategy": None if w.strategy is None else
                     {k: getattr(w.strategy, k) for k in ("dp", "tp", "pp", "sp", "zero", "recompute", "microbatch",
                                                          "num_microbatches", "schedule", "vp", "recompute_layers")},
                     "reason": w.reason} for w in result.why_not],
    })
    summary["mesh"] = mesh_summary(summary["strategy"], cluster)
    if chosen.evaluation.pipeline is not None:
        summary["pipeline"] = pipeline_summary(summary, chosen.evaluation.pipeline)
    if plan is not None:
        summary["plan"] = plan.model_dump(mode="json")
        summary["sharding"] = sharding_summary(summary["plan"]["param_placements"],
                                               [a["name"] for a in summary["plan"]["mesh"] if a["name"] != "pp"])
    return summary


_MESH_AXES = ("pp", "dp", "tp")  # row-major, tp innermost: the runtime's order (runtime/mesh.py)


def mesh_summary(strategy: dict[str, Any], cluster: Any) -> dict[str, Any]:
    """Where each mesh axis's groups sit on the cluster, and which link they talk over.

    Groups are described by size and stride instead of listed, so a 1,024-GPU summary stays small;
    `group_ranks` lists any one group.
    """
    sizes = {axis: int(strategy[axis]) for axis in _MESH_AXES}
    per_node = cluster.gpus_per_node
    intra = getattr(cluster, "intra_node", None)
    inter = getattr(cluster, "inter_node", None)
    links = {"intra_node": None if intra is None else {"name": intra.name, "bandwidth_bytes_per_s": intra.effective_bandwidth_bytes_per_s},
             "inter_node": None if inter is None else {"name": inter.name, "bandwidth_bytes_per_s": inter.effective_bandwidth_bytes_per_s}}
    axes = {}
    stride = 1
    for axis in reversed(_MESH_AXES):
        size = sizes[axis]
        first = [k * stride for k in range(size)]
        nodes = len({rank // per_node for rank in first})
        inside = nodes == 1
        if size == 1:
            link = "none"
        elif inside:
            link = links["intra_node"]["name"] if links["intra_node"] else "intra-node"
        else:
            link = links["inter_node"]["name"] if links["inter_node"] else "inter-node"
        axes[axis] = {"size": size, "stride": stride, "groups": cluster.world_size // size, "nodes_per_group": nodes,
                      "within_node": inside, "link": link, "first_group": first}
        stride *= size
    return {"order": list(_MESH_AXES), "world_size": cluster.world_size, "gpus_per_node": per_node,
            "num_nodes": cluster.num_nodes, "links": links, "axes": axes}


def group_ranks(mesh: dict[str, Any], axis: str, rank: int) -> list[int]:
    """The ranks of `rank`'s group along `axis` (vary that axis's coordinate, keep the others)."""
    info = mesh["axes"][axis]
    stride, size = info["stride"], info["size"]
    base = rank - ((rank // stride) % size) * stride
    return [base + k * stride for k in range(size)]


def coordinates(mesh: dict[str, Any], rank: int) -> dict[str, int]:
    """A rank's (pp, dp, tp) coordinates in the row-major mesh."""
    return {axis: (rank // mesh["axes"][axis]["stride"]) % mesh["axes"][axis]["size"] for axis in _MESH_AXES}


def pipeline_summary(summary: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """The schedule's inputs and results, enough to redraw it (`autopar.report_timeline`).

    The transfer time between stages is read off the simulated timeline (the first micro-batch's
    forward reaches stage 1 that long after stage 0 finished it). The evaluator keeps the
    per-rank gradient-sync and optimizer times internal; the breakdown holds the critical rank's,
    so other ranks get the optimizer scaled by their optimizer-state bytes and the same exposed
    sync, capped so that no rank ends after the step.
    """
    s = summary["strategy"]
    p = summary["predicted"]
    p2p_s = 0.0
    if s["pp"] > 1:
        first = {(x.kind, x.stage, x.microbatch): x for x in pipe.timeline}
        if ("F", 0, 0) in first and ("F", 1, 0) in first:
            p2p_s = max(first[("F", 1, 0)].start_s - first[("F", 0, 0)].end_s, 0.0)
    ends, busy = list(pipe.rank_end_s), list(pipe.rank_busy_s)
    bubble = p["breakdown"].get("bubble", 0.0)
    matching = [r for r in range(s["pp"]) if abs(max(ends[r] - busy[r], 0.0) - bubble) <= 1e-9 * max(1.0, bubble)]
    critical = max(matching or range(s["pp"]), key=lambda r: ends[r])
    states = [m["optimizer_states"] for m in p["memory_breakdown_bytes"]]
    optimizer = [p["breakdown"].get("optimizer", 0.0) * (x / states[critical] if states[critical] else 1.0)
                 for x in states]
    sync_critical = max(p["step_time_s"] - ends[critical] - optimizer[critical], 0.0)
    sync = [sync_critical if r == critical else max(min(sync_critical, p["step_time_s"] - ends[r] - optimizer[r]), 0.0)
            for r in range(s["pp"])]
    return {"schedule": s["schedule"], "pp": s["pp"], "vp": s["vp"], "num_microbatches": s["num_microbatches"],
            "p2p_s": p2p_s, "makespan_s": pipe.step_time_s, "rank_busy_s": busy, "rank_end_s": ends,
            "critical_rank": critical, "exposed_sync_s": sync, "optimizer_s": optimizer}


_INDEX = re.compile(r"\.(\d+)\.")


def sharding_summary(param_placements: dict[str, str], axes: list[str]) -> list[dict[str, Any]]:
    """Placements per module, repeated layers with identical placements folded into one row."""
    modules: dict[str, dict[str, str]] = {}
    for name, placement in param_placements.items():
        match = _INDEX.search(name)
        if match:
            prefix, index = name[:match.start()], int(match.group(1))
            module, leaf = f"{prefix}.{index}", name[match.end():]
        else:
            module, _, leaf = name.rpartition(".")
            module = module or name
        modules.setdefault(module, {})[leaf] = placement
    rows: list[dict[str, Any]] = []
    for module, params in modules.items():
        prefix, _, index = module.rpartition(".")
        previous = rows[-1] if rows else None
        if (index.isdigit() and previous and previous["prefix"] == prefix and previous["params"] == params
                and previous["last"] == int(index) - 1):
            previous["last"] = int(index)
            previous["count"] += 1
            continue
        rows.append({"prefix": prefix if index.isdigit() else module, "first": int(index) if index.isdigit() else None,
                     "last": int(index) if index.isdigit() else None, "count": 1, "params": params})
    for row in rows:
        if row["first"] is None:
            row["modules"] = row["prefix"]
        elif row["count"] == 1:
            row["modules"] = f"{row['prefix']}.{row['first']}"
        else:
            row["modules"] = f"{row['prefix']}.{row['first']}–{row['last']}"
        row["axes"] = axes
    return rows


def render(summary: dict[str, Any]) -> str:
    s = summary["strategy"]
    p = summary["predicted"]
    cluster = summary["cluster"]
    lines = [
        f"model {summary['model']}, global batch {summary['global_batch']} × seq {summary['seq_len']}",
        f"cluster {cluster['name']}: {cluster['num_nodes']} node(s) × {cluster['gpus_per_node']} {cluster['gpu']} "
        f"= {cluster['world_size']} GPUs",
        "",
        "strategy  " + "  ".join(f"{k}={layers_text(v) if k == 'recompute_layers' else v}" for k, v in s.items()
                                 if v is not None)
        + ("" if not summary["fixed"] else f"   (fixed: {', '.join(summary['fixed'])}; the rest chosen by the cost model)"),
        "",
        f"step time        {p['step_time_s']:.3f} s",
        f"throughput       {p['tokens_per_s']:,.0f} tokens/s",
        f"per GPU          {p['tflops_per_gpu']:.1f} TFLOP/s model FLOPs (MFU {p['mfu']:.1%})",
        f"peak memory      {p['peak_memory_bytes'] / GiB:.1f} GiB of {summary['capacity_bytes'] / GiB:.1f} GiB usable"
        + ("" if summary["fits"] else "   ** DOES NOT FIT **"),
        "",
        "time breakdown (critical pipeline rank)",
    ]
    total = sum(p["breakdown"].values()) or 1.0
    for key, seconds in p["breakdown"].items():
        lines.append(f"  {key:<22} {seconds:8.3f} s  {seconds / total:6.1%}")
    lines += ["", "per pipeline rank: memory (GiB)  params / grads / optimizer / activations / buffers"]
    for rank, parts in enumerate(p["memory_breakdown_bytes"]):
        lines.append(
            f"  rank {rank:<3} {sum(parts.values()) / GiB:6.1f}  = " + " / ".join(
                f"{parts[k] / GiB:.1f}" for k in ("parameters", "gradients", "optimizer_states", "activations", "buffers")
            ) + f" (+{parts['margin'] / GiB:.1f} margin)"
        )
    lines += ["", "stages (one micro-batch on one rank)"]
    for stage in summary["stages"]:
        units = stage["units"]
        shown = ", ".join(units[:3]) + (f", … {units[-1]}" if len(units) > 3 else "")
        lines.append(f"  stage {stage['index']:<3} rank {stage['rank']:<3} {len(units):>3} units  "
                     f"fwd {stage['forward_s'] * 1e3:8.2f} ms  bwd {stage['backward_s'] * 1e3:8.2f} ms  ({shown})"
                     + (f"  recompute {stage['recomputed_layers']} layers" if stage.get("recomputed_layers") else ""))
    if summary["alternatives"]:
        lines += ["", "runners-up"]
        for alt in summary["alternatives"]:
            a = alt["strategy"]
            label = strategy_label(a)
            ratio = alt["predicted"]["step_time_s"] / p["step_time_s"]
            lines.append(f"  {label}: {ratio:.2f}× step time" + ("" if alt["fits"] else ", does not fit"))
    if summary.get("why_not"):
        lines += ["", "why not"]
        for row in summary["why_not"]:
            label = row["label"]
            if row["strategy"]:
                a = row["strategy"]
                label += f" [{strategy_label(a)}]"
            lines.append(f"  {label}: {row['reason']}")
    search = summary.get("search")
    if search:
        lines += ["", f"searched {search['candidates']:,} strategies in {search['seconds']:.1f} s"
                  + (f" (ILP: {search['ilp_variables']:,} variables, {search['ilp_solve_s']:.1f} s"
                     + (f", {search['ilp_budgeted']} solves under a layer's memory budget"
                        if search.get("ilp_budgeted") else "") + ")"
                     if search["ilp_variables"] else "")]
    return "\n".join(lines)


def _predicted_view(predicted_source: Any) -> dict[str, Any]:
    """Predicted figures from a plan summary, a Plan, or a plan's JSON dict (what `run` holds)."""
    if hasattr(predicted_source, "model_dump"):
        predicted_source = predicted_source.model_dump(mode="json")
    if "stages" in predicted_source and "predicted" in predicted_source and "step_time_s" in predicted_source["predicted"] \
            and "peak_memory_bytes_per_stage" in predicted_source["predicted"]:  # a plan_summary
        p = predicted_source["predicted"]
        return {"step_time_s": p["step_time_s"], "peak_memory_bytes": list(p["peak_memory_bytes_per_stage"]),
                "communication_s": p["breakdown"].get("exposed_communication"),
                "compute_s": list(p.get("compute_s_per_stage", []))}
    p = predicted_source.get("predicted") or {}
    return {"step_time_s": p.get("step_time_s"), "peak_memory_bytes": list(p.get("peak_memory_bytes", [])),
            "communication_s": (p.get("breakdown") or {}).get("exposed_communication"),
            "compute_s": list(p.get("compute_s", []))}


def compare(predicted_source: Any, measured: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of predicted against measured, for the figures both sides have.

    `measured` keys (all optional): step_time_s; compute_s (list per pipeline rank: one step's
    forward, backward, recompute and optimizer time, communication excluded); peak_memory_bytes
    (list per pipeline rank); communication_s (exposed communication per step). error_pct = (predicted − measured) / measured × 100.
    """
    predicted = _predicted_view(predicted_source)
    rows: list[dict[str, Any]] = []

    def add(metric: str, unit: str, want: Any, got: Any) -> None:
        if want is None or got is None:
            return
        error = None if not got else (want - got) / got * 100.0
        rows.append({"metric": metric, "unit": unit, "predicted": float(want), "measured": float(got),
                     "error_pct": error})

    add("step time", "s", predicted["step_time_s"], measured.get("step_time_s"))
    for rank, got in enumerate(measured.get("compute_s") or []):
        want = predicted["compute_s"][rank] if rank < len(predicted["compute_s"]) else None
        add(f"compute, pp rank {rank}", "s", want, got)
    for rank, got in enumerate(measured.get("peak_memory_bytes") or []):
        want = predicted["peak_memory_bytes"][rank] if rank < len(predicted["peak_memory_bytes"]) else None
        add(f"peak memory, pp rank {rank}", "bytes", want, got)
    add("exposed communication", "s", predicted["communication_s"], measured.get("communication_s"))
    return rows


def format_value(value: float, unit: str) -> str:
    if unit == "bytes":
        return f"{value / GiB:.2f} GiB"
    return f"{value * 1e3:.2f} ms" if value < 1.0 else f"{value:.3f} s"


def render_comparison(rows: list[dict[str, Any]]) -> str:
    """Predicted against measured as a terminal table."""
    if not rows:
        return "predicted vs measured: nothing measured to compare"
    width = max(len(r["metric"]) for r in rows)
    lines = ["predicted vs measured", f"  {'':<{width}}  {'predicted':>12}  {'measured':>12}  {'error':>8}"]
    for r in rows:
        error = "n/a" if r["error_pct"] is None else f"{r['error_pct']:+.1f}%"
        lines.append(f"  {r['metric']:<{width}}  {format_value(r['predicted'], r['unit']):>12}  "
                     f"{format_value(r['measured'], r['unit']):>12}  {error:>8}")
    return "\n".join(lines)
