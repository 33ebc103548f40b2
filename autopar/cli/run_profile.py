"""`autopar run --profile-steps N`: record N steps with torch.profiler and set them beside the plan's
prediction, closing the loop from plan to measurement.

The first step of the launch warms up (allocator, DTensor sharding propagation, autotuning) and is
not measured. Each rank writes its Chrome trace to `--profile-dir`; rank 0 prints the
predicted-vs-measured table and, with `--report`, appends it to the plan's HTML report.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError


def check_profile_outputs(config) -> None:
    """Refuse unusable outputs before training (one line each)."""
    if not config.profile_steps:
        if config.report:
            raise AutoparError("--report needs --profile-steps N (the measured steps it adds to the report)")
        return
    directory = Path(config.profile_dir)
    if directory.exists() and not directory.is_dir():
        raise AutoparError(f"--profile-dir {directory} is a file: give a directory")
    if config.report and not Path(config.report).is_file():
        raise AutoparError(f"--report {config.report} not found: write it first with `autopar plan ... --report "
                           f"{config.report}` (the run appends its measurements to that page)")


def train_with_profile(loop, first_step: int, stop, reporter, num_params: int, peak, nominal: bool) -> None:
    """Warm-up step, N profiled steps, then the rest; stops early on SIGTERM like the plain loop."""
    config = loop.config
    last = config.steps
    # `loop.stopped`, not this rank's own flag: every rank must agree, or one waits in `_profiled`'s barrier
    loop.loop(first_step, first_step, stop, reporter, num_params, peak, nominal)
    if loop.stopped:
        return
    window_start = first_step + 1
    window_end = min(first_step + config.profile_steps, last)
    if window_start > window_end:
        reporter.say(f"--profile-steps: no step left to profile after the warm-up step {first_step}")
        return
    measured, trained = _profiled(loop, window_start, window_end, stop, reporter, num_params, peak, nominal)
    _report(loop, measured, reporter)
    if trained == window_end and not loop.stopped and window_end < last:
        loop.loop(window_end + 1, last, stop, reporter, num_params, peak, nominal)


def _profiled(loop, start: int, end: int, stop, reporter, num_params, peak, nominal) -> tuple[dict, int]:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    device = loop.parallel.layout.device
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    grouped = dist.is_initialized()
    if grouped:
        dist.barrier()
    with profile(activities=activities) as profiler:
        started = time.perf_counter()
        trained = loop.loop(start, end, stop, reporter, num_params, peak, nominal)
        if cuda:
            torch.cuda.synchronize(device)
        elapsed_s = time.perf_counter() - started
    steps = trained - start + 1
    rank = dist.get_rank() if grouped else 0
    directory = Path(loop.config.profile_dir)
    directory.mkdir(parents=True, exist_ok=True)
    trace = directory / f"rank{rank}.trace.json"
    events = profiler.events()
    profiler.export_chrome_trace(str(trace))
    mine = {"pp_rank": loop.parallel.layout.pp_rank, "step_time_s": elapsed_s / max(steps, 1),
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
            "communication_s": collective_time_s(events, cuda) / max(steps, 1),
            "compute_s": compute_time_s(events, cuda) / max(steps, 1)}
    everyone = [mine]
    if grouped:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    reporter.say(f"profiled steps {start}-{trained}: traces in {directory}/rank*.trace.json "
                 f"(open in https://ui.perfetto.dev)")
    return _combine(everyone), trained


def _combine(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One measurement per plan figure: the slowest rank's step, each pipeline rank's largest peak
    and longest compute, and rank 0's time in collectives (the plan predicts the critical rank's
    exposed part)."""
    ranks = max(r["pp_rank"] for r in per_rank) + 1
    measured: dict[str, Any] = {"step_time_s": max(r["step_time_s"] for r in per_rank),
                                "communication_s": per_rank[0]["communication_s"],
                                "compute_s": [max(r["compute_s"] for r in per_rank if r["pp_rank"] == p)
                                              for p in range(ranks)]}
    if all(r["peak_memory_bytes"] is not None for r in per_rank):
        measured["peak_memory_bytes"] = [max(r["peak_memory_bytes"] for r in per_rank if r["pp_rank"] == p)
                                         for p in range(ranks)]
    return measured


def _is_collective(event, cuda: bool) -> bool:
    """NCCL kernels on the GPU, gloo's work on the CPU."""
    if cuda:
        return "nccl" in event.name.lower() and _on_gpu(event)
    return event.name.startswith("gloo:")


def _on_gpu(event) -> bool:
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def _interval(event) -> tuple[float, float]:
    begin = event.time_range.start
    return begin, begin + event.time_range.elapsed_us()


def collective_time_s(events, cuda: bool) -> float:
    """Wall time covered by collectives. Overlapping events are counted once (the union of their intervals)."""
    return union_length_us([_interval(e) for e in events if _is_collective(e, cuda)]) / 1e6


def compute_time_s(events, cuda: bool) -> float:
    """Wall time covered by computation: GPU kernels other than NCCL's on CUDA; on the CPU the
    top-level operators (`aten::`), whose children lie inside them. Collectives are not compute,
    and on the CPU time inside a collective's interval is taken out (gloo copies with aten ops)."""
    if cuda:
        compute = [_interval(e) for e in events if _on_gpu(e) and not _is_collective(e, cuda)
                   and not e.name.startswith(("Memcpy", "Memset"))]
        return union_length_us(compute) / 1e6
    compute = [_interval(e) for e in events if e.name.startswith("aten::")]
    collectives = [_interval(e) for e in events if _is_collective(e, cuda)]
    return (union_length_us(compute) - overlap_length_us(compute, collectives)) / 1e6


def overlap_length_us(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> float:
    """Length of (union of `first`) ∩ (union of `second`)."""
    merged_first, merged_second = merge(first), merge(second)
    total, j = 0.0, 0
    for begin, end in merged_first:
        while j < len(merged_second) and merged_second[j][1] <= begin:
            j += 1
        k = j
        while k < len(merged_second) and merged_second[k][0] < end:
            total += min(end, merged_second[k][1]) - max(begin, merged_second[k][0])
            k += 1
    return total


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for begin, end in sorted(intervals):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        elif end > begin:
            merged.append((begin, end))
    return merged


def union_length_us(intervals: list[tuple[float, float]]) -> float:
    return sum(end - begin for begin, end in merge(intervals))


def _report(loop, measured: dict[str, Any], reporter) -> None:
    from autopar.report import compare, render_comparison

    plan = loop.plan
    if plan.predicted is None:
        reporter.say("the plan has no prediction to compare with")
        return
    rows = compare(plan, measured)
    reporter.say(render_comparison(rows))
    reporter.say(f"(predicted for cluster {plan.provenance.cluster_name}; measured on this launch's "
                 f"{loop.parallel.layout.device.type} devices: compare on the hardware the plan was made for)")
    if loop.config.report and reporter.active:
        from autopar.report import append_measured_section

        append_measured_section(loop.config.report, rows)
        reporter.say(f"appended predicted vs measured to {loop.config.report}")
