"""Compute time of ops and units on one GPU: a roofline with per-op-class efficiencies.

time(op) = max(FLOPs / (peak · η_class), bytes / (HBM bandwidth · η_memory)) + launch overhead.

The efficiencies are the fraction of datasheet peak that real kernels reach. Defaults and sources:
- η_matmul = 0.80: a bf16 8192³ matmul ran at 790 TFLOP/s of the H100's 989 on the lent H100
  (measurement quoted in issue #3/#6, 2026-11-22). Not yet re-measured on other GPUs.
- η_attention = 0.60: FlashAttention-2 reaches 50–73% of peak forward+backward on A100
  (Dao, "FlashAttention-2", 2023, §4.1); we take the middle of that range.
- η_memory = 0.85 and 4 µs per kernel launch: nominal until the profiler (issue #3) measures the
  HBM ceiling and launch cost on the target GPU; a profile database replaces all of these.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import GpuSpec
from autopar.cost_models.facts import OpFacts, Unit


@dataclass(frozen=True)
class Efficiency:
    matmul: float = 0.80
    attention: float = 0.60
    memory: float = 0.85
    launch_overhead_s: float = 4e-6


DEFAULT_EFFICIENCY = Efficiency()


def op_time_s(op: OpFacts, gpu: GpuSpec, dtype: str, *, batch: int, tp: int, sp: bool,
              efficiency: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """One op for a micro-batch of `batch` samples on one of `tp` tensor-parallel ranks."""
    if op.kind == "view":
        return 0.0
    divide = tp if (op.tp_sharded or (sp and op.kind == "vector")) else 1
    flops = op.flops * batch / divide
    moved = (op.activation_bytes * batch + op.weight_bytes) / divide
    memory_time = moved / (gpu.hbm_bandwidth_bytes_per_s * efficiency.memory)
    if op.kind == "vector":
        return memory_time + efficiency.launch_overhead_s
    class_efficiency = efficiency.attention if op.kind == "attention" else efficiency.matmul
    compute_time = flops / (gpu.peak_flops_per_s(dtype) * class_efficiency)
    return max(compute_time, memory_time) + efficiency.launch_overhead_s


@dataclass(frozen=True)
class UnitTime:
    """Per micro-batch, on one rank of the unit's stage."""

    forward_s: float
    backward_s: float
    forward_vector_s: float  # the part selective recompute repeats
    forward_reduce_bytes: float  # tp all-reduce volume (whole tensors) in forward
    backward_reduce_bytes: float
    forward_reduces: int
    backward_reduces: int
    forward_collectives: tuple[tuple[str, float], ...] = ()  # other tp collectives: (kind, bytes)
    backward_collectives: tuple[tuple[str, float], ...] = ()


def unit_time(unit: Unit, gpu: GpuSpec, dtype: str, *, batch: int, tp: int, sp: bool,
              efficiency: Efficiency = DEFAULT_EFFICIENCY) -> UnitTime:
    def total(ops, kinds=None) -> float:
        return sum(op_time_s(op, gpu, dtype, batch=batch, tp=tp, sp=sp, efficiency=efficiency)
                   for op in ops if kinds is None or op.kind in kinds)

    forward_reduce = [op.reduce_bytes_for(batch) for op in unit.forward_ops if op.reduce_bytes]
    backward_reduce = [op.reduce_bytes_for(batch) for op in unit.backward_ops if op.reduce_bytes]
    return UnitTime(
        forward_s=total(unit.forward_ops),
        backward_s=total(unit.backward_ops),
        forward_vector_s=total(unit.forward_ops, {"vector"}),
        forward_reduce_bytes=sum(forward_reduce),
        backward_reduce_bytes=sum(backward_reduce),
        forward_reduces=len(forward_reduce),
        backward_reduces=len(backward_reduce),
        forward_collectives=tuple((kind, size * batch) for op in unit.forward_ops for kind, size in op.collectives),
        backward_collectives=tuple((kind, size * batch) for op in unit.backward_ops for kind, size in op.collectives),
    )
