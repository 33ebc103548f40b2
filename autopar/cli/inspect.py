"""What `autopar inspect` reports: a model's size, work and memory, from its op graph."""

from __future__ import annotations

import math
from typing import Any

from autopar.graph.ir import OpGraph


def summarize(graph: OpGraph, capture_seconds: float | None = None) -> dict[str, Any]:
    """Plain-data summary of an op graph (the `--json` output)."""
    tokens = graph.tokens
    memory = graph.step_memory
    forward_nodes = sum(1 for n in graph.nodes if n.phase == "forward")
    summary: dict[str, Any] = {
        "model": graph.model_name,
        "model_fingerprint": graph.model_fingerprint,
        "precision": graph.precision,
        "batch": graph.batch,
        "seq_len": graph.seq_len,
        "tokens_per_step": tokens,
        "parameters": graph.num_params,
        "tied_parameters": {p.name: p.aliases for p in graph.params if p.aliases},
        "forward_flops": graph.forward_flops,
        "backward_flops": graph.backward_flops,
        "step_flops": graph.forward_flops + graph.backward_flops,
        "forward_flops_per_token": graph.forward_flops / tokens if tokens else None,
        "step_flops_per_token": (graph.forward_flops + graph.backward_flops) / tokens if tokens else None,
        "layer_types": [
            {
                "id": lt.id,
                "class": lt.class_name,
                "count": len(lt.instances),
                "first": lt.instances[0],
                "params_per_instance": lt.params_per_instance,
                "forward_flops_per_instance": lt.forward_flops_per_instance,
                "ops_per_instance": lt.nodes_per_instance,
            }
            for lt in graph.layer_types
        ],
        "memory_bytes": {
            "parameters": memory.param_bytes,
            "gradients": memory.grad_bytes,
            "optimizer_states": memory.optimizer_state_bytes,
            "model_states_total": memory.param_bytes + memory.grad_bytes + memory.optimizer_state_bytes,
            "saved_activations": sum(n.saved_bytes for n in graph.nodes),
        },
        "moe_layers": [layer.model_dump() for layer in graph.moe_layers],
        "graph": {"forward_ops": forward_nodes, "backward_ops": len(graph.nodes) - forward_nodes},
        "torch_version": graph.torch_version,
    }
    if capture_seconds is not None:
        summary["capture_seconds"] = round(capture_seconds, 3)
    return summary


def cluster_fit(summary: dict[str, Any], cluster: Any) -> dict[str, Any]:
    """How many of the cluster's GPUs the model states alone need when fully sharded (ZeRO-3).

    A lower bound: activations, buffers and fragmentation come on top (the cost model's job).
    """
    gpu_bytes = cluster.gpu.memory_bytes
    states = summary["memory_bytes"]["model_states_total"]
    return {
        "cluster": cluster.name,
        "gpu": cluster.gpu.name,
        "world_size": cluster.world_size,
        "gpu_memory_bytes": gpu_bytes,
        "min_gpus_for_model_states": max(1, math.ceil(states / gpu_bytes)),
        "model_states_per_gpu_fully_sharded_bytes": states // cluster.world_size,
    }


def render(summary: dict[str, Any]) -> str:
    """The human-readable table."""
    rows: list[tuple[str, str]] = [
        ("model", f"{summary['model']}  (fingerprint {summary['model_fingerprint']})"),
        ("precision", summary["precision"]),
        ("batch × seq", f"{summary['batch']} × {summary['seq_len']}  ({_count(summary['tokens_per_step'])} tokens/step)"),
        ("parameters", _count(summary["parameters"])),
    ]
    for name, aliases in summary["tied_parameters"].items():
        rows.append(("  tied", f"{name} = {', '.join(aliases)}"))
    rows += [
        ("forward FLOPs", f"{_flops(summary['forward_flops'])}  ({_flops(summary['forward_flops_per_token'])}/token)"),
        ("backward FLOPs", f"{_flops(summary['backward_flops'])}  (×{summary['backward_flops'] / max(summary['forward_flops'], 1):.2f} forward)"),
        ("step FLOPs/token", _flops(summary["step_flops_per_token"])),
    ]
    memory = summary["memory_bytes"]
    rows += [
        ("weights", _bytes(memory["parameters"])),
        ("gradients", _bytes(memory["gradients"])),
        ("optimizer states", _bytes(memory["optimizer_states"]) + "  (Adam moments + fp32 master weights)"),
        ("model states", _bytes(memory["model_states_total"])),
        ("saved activations", _bytes(memory["saved_activations"]) + "  (this batch, no recompute)"),
        ("graph", f"{summary['graph']['forward_ops']} forward + {summary['graph']['backward_ops']} backward ops"),
    ]
    if "capture_seconds" in summary:
        rows.append(("captured in", f"{summary['capture_seconds']:.1f} s"))
    width = max(len(key) for key, _ in rows)
    lines = [f"{key:<{width}}  {value}" for key, value in rows]
    lines.append("")
    lines.append("layer types")
    if not summary["layer_types"]:
        lines.append("  (no repeated blocks found)")
    for lt in summary["layer_types"]:
        lines.append(
            f"  {lt['id']}: {lt['class']} × {lt['count']}  (first {lt['first']}; "
            f"{_count(lt['params_per_instance'])} params, {_flops(lt['forward_flops_per_instance'])} fwd, "
            f"{lt['ops_per_instance']} ops each)"
        )
    moe = summary.get("moe_layers") or []
    if moe:
        first = moe[0]
        factor = first["capacity_factor"]
        capacity = "dropless" if factor is None and not first["autopar_dispatch"] else (
            f"capacity factor {factor}" if factor is not None else "capacity = sequence (nothing dropped)")
        lines.append("")
        lines.append(f"mixture of experts: {len(moe)} layers ({first['class_name']}, first {first['module_path']}): "
                     f"{first['experts']} experts, top {first['top_k']}, {capacity}; "
                     f"{_count(sum(layer['expert_param_elements'] for layer in moe))} expert params; "
                     f"{first['dispatch_rows_per_sample']:,} rows of {first['hidden']} per sequence per all-to-all")
    fit = summary.get("cluster_fit")
    if fit:
        lines.append("")
        lines.append(
            f"cluster {fit['cluster']}: {fit['world_size']} × {fit['gpu']} ({_bytes(fit['gpu_memory_bytes'])} each); "
            f"model states need ≥ {fit['min_gpus_for_model_states']} GPUs fully sharded, "
            f"{_bytes(fit['model_states_per_gpu_fully_sharded_bytes'])}/GPU over all {fit['world_size']} "
            f"(activations not included)"
        )
    return "\n".join(lines)


def _count(value: float | None) -> str:
    if value is None:
        return "-"
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {suffix}"
    return f"{value:.0f}"


def _flops(value: float | None) -> str:
    if value is None:
        return "-"
    for scale, suffix in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {suffix}"
    return f"{value:.0f} FLOP"


def _bytes(value: float) -> str:
    for scale, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {suffix}"
    return f"{value:.0f} B"
