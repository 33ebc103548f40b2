"""The predicted training step as a Chrome/Perfetto trace (Trace Event Format, JSON).

One process per pipeline rank (all dp×cp×tp GPUs of a rank run the same timeline), with tracks for
compute (forward/backward passes, which include their tensor-parallel collectives and, under cp,
the attention exchange left exposed, as the cost model does, then the optimizer step), point-to-point sends between stages, and the exposed
data-parallel gradient sync. Times are microseconds from the start of the step, so the file
opens beside a torch.profiler trace in Perfetto or chrome://tracing. Built from the report model only.
"""

from __future__ import annotations

import json
from typing import Any

from autopar.plan_schema import stage_rank
from autopar.report.model import Report
from autopar.report.timeline import p2p_s, timeline

US_PER_S = 1e6
COMPUTE_TID = 1
SEND_TID = 10  # first send lane; overlapping sends get the next lanes (11, 12, ...)
SYNC_TID = 2


def _lane(lanes: dict[tuple[int, int], list[float]], pid: int, base: int, start_us: float, end_us: float) -> int:
    """First lane of `base` free at `start_us`, so events on one track never overlap."""
    free = lanes.setdefault((pid, base), [])
    for index, busy_until in enumerate(free):
        if busy_until <= start_us + 1e-6:
            free[index] = end_us
            return base + index
    free.append(end_us)
    return base + len(free) - 1


def trace_events(report: Report) -> dict[str, Any]:
    """The trace as a dict: {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}."""
    s = report.strategy
    pp, stages = s.pp, s.pp * s.vp
    p2p_us = p2p_s(report) * US_PER_S
    gpus_per_rank = s.dp * s.cp * s.tp
    events: list[dict[str, Any]] = []
    lanes: dict[tuple[int, int], list[float]] = {}
    send_lanes: set[tuple[int, int]] = set()
    rank_end_us = [0.0] * pp

    def complete(name: str, cat: str, pid: int, tid: int, start_us: float, dur_us: float, **args: Any) -> None:
        events.append({"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": round(start_us, 3),
                       "dur": round(dur_us, 3), "args": args})

    included = "tensor-parallel collectives" + (f" and the MoE dispatch/combine all-to-alls (ep={s.ep})"
                                                 if s.ep > 1 else "")
    if s.cp > 1:
        exposed_s = report.predicted.breakdown.context_exchange / max(s.num_microbatches, 1)
        included += (f" and the context-parallel attention exchange (cp={s.cp} {s.cp_kind}), "
                     f"{exposed_s * 1e3:.3f} ms per micro-batch not hidden behind attention")
    for x in timeline(report):
        start_us, end_us = x.start_s * US_PER_S, x.end_s * US_PER_S
        rank_end_us[x.rank] = max(rank_end_us[x.rank], end_us)
        forward = x.kind == "F"
        complete(f"{'forward' if forward else 'backward'} mb{x.microbatch} stage{x.stage}",
                 "forward" if forward else "backward", x.rank, COMPUTE_TID, start_us, end_us - start_us,
                 microbatch=x.microbatch, virtual_stage=x.stage, includes=included)
        target = x.stage + 1 if forward else x.stage - 1
        # a W pass sends nothing; zbv's V hands over in place where it turns
        if pp > 1 and p2p_us > 0 and 0 <= target < stages and x.kind != "W" \
                and stage_rank(target, pp, s.schedule) != x.rank:
            tid = _lane(lanes, x.rank, SEND_TID, end_us, end_us + p2p_us)
            send_lanes.add((x.rank, tid))
            complete(f"send {'activations' if forward else 'gradients'} mb{x.microbatch} → stage{target}",
                     "p2p", x.rank, tid, end_us, p2p_us, microbatch=x.microbatch, to_stage=target,
                     to_rank=stage_rank(target, pp, s.schedule))
    pipeline = report.pipeline
    sync_s = pipeline.exposed_sync_s if pipeline is not None else [0.0] * pp
    optimizer_s = pipeline.optimizer_s if pipeline is not None else [report.predicted.breakdown.optimizer] * pp
    for rank in range(pp):
        start_us = rank_end_us[rank]
        if sync_s[rank] > 0:
            complete("gradient sync (exposed)", "dp", rank, SYNC_TID, start_us, sync_s[rank] * US_PER_S,
                     note="data-parallel reduction not hidden behind the last backward, plus ZeRO gathers")
            start_us += sync_s[rank] * US_PER_S
        offload_s = pipeline.offload_transfer_s[rank] if pipeline is not None and pipeline.offload_transfer_s else 0.0
        if offload_s > 0:
            complete("PCIe offload copies (exposed)", "offload", rank, SYNC_TID, start_us, offload_s * US_PER_S,
                     note="parameter shards host→device and gradient shards device→host not hidden behind the passes")
            start_us += offload_s * US_PER_S
        if optimizer_s[rank] > 0:
            on_cpu = s.offload != "none"
            complete("CPU optimizer step" if on_cpu else "optimizer step", "optimizer", rank, COMPUTE_TID, start_us,
                     optimizer_s[rank] * US_PER_S, **({"where": "host CPU (offload=optimizer)"} if on_cpu else {}))
    metadata: list[dict[str, Any]] = []
    for rank in range(pp):
        first = rank * gpus_per_rank
        metadata += [
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
             "args": {"name": f"pp rank {rank} (GPUs {first}–{first + gpus_per_rank - 1})"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": COMPUTE_TID, "args": {"name": "compute"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": SYNC_TID, "args": {"name": "communication: dp sync"}},
        ]
    for rank, tid in sorted(send_lanes):
        metadata.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                         "args": {"name": f"communication: p2p send{'' if tid == SEND_TID else f' {tid - SEND_TID + 1}'}"}})
    return {"traceEvents": metadata + events, "displayTimeUnit": "ms",
            "otherData": {"source": "autopar plan (predicted)", "model": report.model,
                          "strategy": s.model_dump_json(), "step_time_s": report.predicted.step_time_s,
                          **({"context_exchange_s": report.predicted.breakdown.context_exchange} if s.cp > 1
                             else {})}}


def render_trace(report: Report) -> str:
    return json.dumps(trace_events(report), separators=(",", ":"))
