"""What `autopar plan` reports: the chosen strategy, its prediction, stages, runners-up and why-not rows.

One report model (`plan_summary`, plain data: the `--json` output) and its terminal renderer.
"""

from __future__ import annotations

from typing import Any

from cost_models.evaluate import Evaluation

GiB = 2**30


def strategy_dict(evaluation: Evaluation) -> dict[str, Any]:
    s = evaluation.strategy
    return {"dp": s.dp, "tp": s.tp, "pp": s.pp, "sp": s.sp, "zero": s.zero, "recompute": s.recompute,
            "microbatch": s.microbatch, "num_microbatches": s.num_microbatches, "schedule": s.schedule, "vp": s.vp}


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
            "breakdown": evaluation.breakdown,
        },
        "stages": [
            {"index": stage.index, "rank": stage.rank, "units": list(stage.units),
             "forward_s": stage.forward_s, "backward_s": stage.backward_s}
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
                   "rejected": result.rejected},
        "alternatives": [evaluation_summary(c.evaluation) for c in result.ranked if c is not chosen],
        "why_not": [{"label": w.label, "strategy": None if w.strategy is None else
                     {k: getattr(w.strategy, k) for k in ("dp", "tp", "pp", "sp", "zero", "recompute", "microbatch",
                                                          "num_microbatches", "schedule", "vp")},
                     "reason": w.reason} for w in result.why_not],
    })
    if plan is not None:
        summary["plan"] = plan.model_dump(mode="json")
    return summary


def render(summary: dict[str, Any]) -> str:
    s = summary["strategy"]
    p = summary["predicted"]
    cluster = summary["cluster"]
    lines = [
        f"model {summary['model']}, global batch {summary['global_batch']} × seq {summary['seq_len']}",
        f"cluster {cluster['name']}: {cluster['num_nodes']} node(s) × {cluster['gpus_per_node']} {cluster['gpu']} "
        f"= {cluster['world_size']} GPUs",
        "",
        "strategy  " + "  ".join(f"{k}={v}" for k, v in s.items())
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
                     f"fwd {stage['forward_s'] * 1e3:8.2f} ms  bwd {stage['backward_s'] * 1e3:8.2f} ms  ({shown})")
    if summary["alternatives"]:
        lines += ["", "runners-up"]
        for alt in summary["alternatives"]:
            a = alt["strategy"]
            label = " ".join(f"{k}={a[k]}" for k in ("dp", "tp", "pp", "microbatch", "schedule", "vp", "zero",
                                                     "recompute", "sp"))
            ratio = alt["predicted"]["step_time_s"] / p["step_time_s"]
            lines.append(f"  {label}: {ratio:.2f}× step time" + ("" if alt["fits"] else ", does not fit"))
    if summary.get("why_not"):
        lines += ["", "why not"]
        for row in summary["why_not"]:
            label = row["label"]
            if row["strategy"]:
                a = row["strategy"]
                label += " [" + " ".join(f"{k}={a[k]}" for k in ("dp", "tp", "pp", "microbatch", "schedule", "vp",
                                                                "zero", "recompute", "sp")) + "]"
            lines.append(f"  {label}: {row['reason']}")
    search = summary.get("search")
    if search:
        lines += ["", f"searched {search['candidates']:,} strategies in {search['seconds']:.1f} s"
                  + (f" (ILP: {search['ilp_variables']:,} variables, {search['ilp_solve_s']:.1f} s)"
                     if search["ilp_variables"] else "")]
    return "\n".join(lines)
