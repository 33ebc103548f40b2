"""Roofline efficiencies calibrated from a profile database, so the fallback for unprofiled ops
(and for sharded shapes not measured) agrees with what the GPU measured.

For the ops of a traced graph that the database holds for one device, at their traced shapes:
- η_matmul: the GEMM ceiling that, through the same shape model the predictions use (each small
  dimension's penalty, `compute.gemm_efficiency`, and the misaligned-width factor), gives the median
  achieved FLOP/s over peak of the larger half (by FLOPs) of matmul ops: the measured efficiency
  divided by the shape's factor, so the penalty is not counted twice;
- η_attention: the same over fused-attention ops;
- η_memory: the HBM bandwidth fraction at which the elementwise ops moving ≥ 1 MiB, priced as a step
  prices them (bytes over that bandwidth, plus the per-kernel time each), sum to the time they
  took: total bytes over total time less a per-kernel time per op. An op timed alone pays a fixed
  floor beside its bytes; the per-kernel time takes it, not the bandwidth. The median of each op's
  bytes over its time, used before, charged the floor to every byte and weighed a 1 MiB op as
  much as a 1 GiB one: the shared H100 profile's median is 0.61 where its ops sum to 0.82, and the
  step, whose vector ops move autocast's larger bytes, then paid the floor twice (+4% to +19% on
  the H100 rows at 0c55a6b). Where the per-kernel time alone takes all their time: 1, the cap;
- launch overhead: median time of elementwise ops moving < 64 KiB (their time is mostly launch),
  from at least `MIN_LAUNCH_SAMPLES` of them: a profile times each op alone, synchronized, so a
  handful of tiny ops measures the timer's own latency more than a launch in a busy stream. This
  is the kernel's own floor on the device; the fitted per-kernel time it replaces also holds the
  host's dispatch between kernels (`cost_models.compute`), which a profile of ops timed alone
  cannot see.
A class with no samples keeps the base's value (`FITTED_EFFICIENCY` by default: one fitted GEMM
efficiency and per-kernel time), and the result says which constants were measured and from how
many ops.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from autopar.cluster import GpuSpec
from autopar.graph.ir import OpGraph, OpNode
from autopar.cost_models.compute import DEFAULT_EFFICIENCY, MISALIGNED_GEMM_FACTOR, Efficiency, gemm_efficiency
from autopar.cost_models.tp_shards import CONTRACTIONS, op_packet

_LARGE_BYTES = 2**20
_SMALL_BYTES = 64 * 2**10
MIN_LAUNCH_SAMPLES = 20


@dataclass(frozen=True)
class Calibration:
    efficiency: Efficiency
    device_name: str
    samples: dict[str, int] = field(default_factory=dict)  # constant → ops it was measured from (0: default)


def _kind(node: OpNode) -> str:
    if node.is_view:
        return "view"
    if any(marker in node.op for marker in ("scaled_dot_product", "flash_attention", "efficient_attention")):
        return "attention"
    return "matmul" if node.flops else "vector"


def calibrate(graph: OpGraph, times_s: dict[str, float], gpu: GpuSpec, device_name: str,
              base: Efficiency = DEFAULT_EFFICIENCY) -> Calibration:
    """`times_s`: measured seconds per graph node name (nodes not measured are left out)."""
    peak = gpu.peak_flops_per_s(graph.precision)
    by_kind: dict[str, list[tuple[OpNode, float]]] = {"matmul": [], "attention": [], "vector": []}
    for node in graph.nodes:
        time_s = times_s.get(node.name)
        kind = _kind(node)
        if time_s and time_s > 0 and kind in by_kind:
            by_kind[kind].append((node, time_s))

    values: dict[str, float] = {}
    samples: dict[str, int] = {"matmul": 0, "attention": 0, "memory": 0, "launch_overhead_s": 0}
    for kind in ("matmul", "attention"):
        measured = sorted(by_kind[kind], key=lambda item: item[0].flops, reverse=True)
        large = measured[: max(1, len(measured) // 2)] if measured else []
        if large:
            shape = (lambda n: _gemm_shape_factor(n, gpu, graph.precision, base)) if kind == "matmul" else \
                (lambda n: 1.0)
            values[kind] = min(1.0, statistics.median(n.flops / t / peak / shape(n) for n, t in large))
            samples[kind] = len(large)
    tiny = [t for n, t in by_kind["vector"] if n.bytes_read + n.bytes_written < _SMALL_BYTES]
    if len(tiny) >= MIN_LAUNCH_SAMPLES:
        values["launch_overhead_s"] = statistics.median(tiny)
        samples["launch_overhead_s"] = len(tiny)
    moving = [(n.bytes_read + n.bytes_written, t) for n, t in by_kind["vector"]
              if n.bytes_read + n.bytes_written >= _LARGE_BYTES]
    if moving:
        per_kernel_s = values.get("launch_overhead_s", base.launch_overhead_s)
        values["memory"] = min(1.0, _bytes_per_s(moving, per_kernel_s) / gpu.hbm_bandwidth_bytes_per_s)
        samples["memory"] = len(moving)
    return Calibration(efficiency=replace(base, **values), device_name=device_name, samples=samples)


def _bytes_per_s(moved_and_times: list[tuple[int, float]], per_kernel_s: float) -> float:
    """The bandwidth at which these ops, priced as a step prices them (bytes over the bandwidth plus
    `per_kernel_s` each), sum to the time they took; unbounded where the per-kernel time alone takes
    it all (the limit as what is left for the bytes shrinks to none; the caller caps it at HBM's)."""
    moved = sum(b for b, _ in moved_and_times)
    left = sum(t for _, t in moved_and_times) - per_kernel_s * len(moved_and_times)
    return moved / left if left > 0 else math.inf


def _gemm_shape_factor(node: OpNode, gpu: GpuSpec, dtype: str, base: Efficiency) -> float:
    """What the predictions' shape model multiplies the ceiling by for this GEMM at its traced shape
    (as `compute.op_time_s` does from the graph facts' `GemmShape`); 1 for a non-GEMM."""
    contraction = CONTRACTIONS.get(op_packet(node))
    if contraction is None or len(node.input_meta) <= max(contraction):
        return 1.0
    left, right = (node.input_meta[i].shape for i in contraction)
    if len(left) == 2 and len(right) == 2:
        dims = (1.0, float(left[0]), float(right[1]), float(left[1]))
    elif len(left) == 3 and len(right) == 3:
        dims = (float(left[0]), float(left[1]), float(right[2]), float(left[2]))
    else:
        return 1.0
    factor = gemm_efficiency(dims, 1.0, base.gemm_half_dim_for(gpu, dtype))
    if dtype in ("bf16", "fp16") and any(d % 8 for d in dims[1:]):
        factor *= MISALIGNED_GEMM_FACTOR
    return factor


def calibrate_from_database(graph: OpGraph, db, gpu: GpuSpec, device_name: str) -> Calibration:
    """Look up every node of `graph` (at its traced shape) in a `profiler.database.ProfileDB`."""
    from autopar.profiler.signatures import needs_profile, signature_of

    times = {}
    for node in graph.nodes:
        if needs_profile(node):
            time_s = db.lookup_time_s(device_name, graph.precision, signature_of(node))
            if time_s:
                times[node.name] = time_s
    return calibrate(graph, times, gpu, device_name)


def profiled_batch(signature_keys: list[str], seq_len: int | None) -> int | None:
    """The batch a profile was recorded at, read off its op signatures: the most common leading
    dimension of tensors shaped [batch, seq_len, width, ...]; None when no signature shows one. Calibrating
    on the graph traced at that batch matches the profile's elementwise ops, whose shapes carry it."""
    import re
    from collections import Counter

    if not seq_len:
        return None
    found = Counter(int(batch) for key in signature_keys for batch in re.findall(rf"\[(\d+),{seq_len},\d+", key))
    return found.most_common(1)[0][0] if found else None
