"""Compute time of ops and units on one GPU: a roofline with per-op-class efficiencies.

time(op) = max(FLOPs / (peak · η_class), bytes / (HBM bandwidth · η_memory)) + launch overhead.

The efficiencies are the fraction of datasheet peak that real kernels reach. Defaults and sources:
- η_matmul: one GEMM efficiency for every GPU and shape, fitted (`FITTED_EFFICIENCY`, below) with
  the per-kernel time. Timed kernels say GEMMs barely depend on shape: the 268 per-rank products of
  the published runs, timed back to back on an H200, ran at 65–67% of peak in every size band
  (`benchmarks/gemm_shapes.py --report`), and a GEMM took the same time on an H100 and an H200
  (`benchmarks/gemm_kernels.py`). A GPU's own ceiling (`GpuSpec.matmul_efficiency`, measured by
  shape search: A100 86.9%, H100 80.3%) is what one large GEMM reaches alone; an `Efficiency.matmul`
  of 0 or None prices at it.
- A shape term, off by default (`gemm_half_ridges` = 0), stays for what-ifs and the basis study
  (`benchmarks/gemm_basis.py`): a GEMM smaller in any dimension d runs at η_matmul · Π d/(d + d_half)
  over its m, n and k on one rank, d_half being `gemm_half_ridges` ridge points of the GPU (peak
  FLOP/s over HBM bytes/s). Fitted on the published runs alone it was 1.71 (until the ninth
  session); it priced GPT-1.3B's GEMMs 27% (H200) to 50% (H100) above the kernels the steps ran,
  and the vector ops' missing autocast bytes hid it.
- η_attention, per FLOP as torch counts a fused attention kernel's: the full square
  (`torch.utils.flop_counter`), of which the causal decoders autopar traces compute about half
  (`CAUSAL_WORK_FRACTION`). A GPU's figure is on the work done (`GpuSpec.attention_efficiency`:
  FlashAttention-2 reaches 50–73% of the A100's peak, Dao 2023 §4.1, and 35% of the H100's, Shah
  et al., "FlashAttention-3", 2024, §1, both counting a causal kernel's FLOPs as half), so it
  is divided by that fraction; an `Efficiency.attention` given (say calibrated from a profile of
  real kernels) is per counted FLOP already.
- η_memory = 0.85: nominal until the profiler (issue #3) measures the HBM ceiling on the target GPU
  (an H200 accumulated gradients at 4.05 TB/s, 84%: `cost_models.weight_passes`); a profile
  database replaces it. Under autocast a vector op moves the bytes `OpFacts.autocast_bytes` counts
  (`cost_models.autocast`), and a GEMM pays the casts of its fp32 inputs as kernels of their own.
- `launch_overhead_s`: a fixed time per kernel (views are none), fitted with η_matmul: the launch,
  the host's dispatch of the op, and a kernel's start and tail, which the roofline misses. It is
  what grows with the count of kernels: with micro-batches, layers and small per-rank work.
- Misaligned GEMMs: a 16-bit GEMM with a dimension that is not a multiple of 8 elements (16 bytes)
  leaves cuBLAS's tensor-core kernels for a fallback (NVIDIA, "Matrix Multiplication Background
  User's Guide", Tensor Core requirements; on the H100 a width-50,257 head ran
  `cutlass_75_tensorop_bf16_s1688gemm`): its efficiency is `MISALIGNED_GEMM_FACTOR` of the aligned one.
  Not under torch.compile: inductor pads such matmuls' operands to the alignment first
  (`torch._inductor.config.shape_padding`, on by default), so they run at the aligned efficiency. Seen
  on an H200 (benchmarks/gpu_runs/h200-2026-11-27-7f4beee.json): GPT-1.3B compiled with its
  vocabulary unpadded stepped in 272.3 ms, padded in 269.4 ms, where eager pays tens of ms.
  Nor where the runtime pads the product (`Efficiency.padded_gemms`, a linear layer
  `autopar.graph.paddable` marks): it runs aligned, and pays for its pad copies
  (`padding_copy_bytes`). The copies are kernels of their own, run before the product on the same
  stream, so their time adds to the product's rather than hiding under its compute. A product that
  inductor pads pays the same copies (the weight in forward, the output gradient in backward): a
  lower bound, since inductor pads the gradient again for the weight's product. On the H200 the
  unpadded compiled step took 2.6–2.9 ms more than the padded one, whether inductor padded it
  (7f4beee) or the runtime did (0621687). With the copies under the product's compute it was
  priced 0.5 ms less.
- Compiled kernels (`Efficiency.compiled`, a stage or block under torch.compile): inductor fuses
  the elementwise and normalization ops between GEMMs (and autocast's casts), so the vector ops
  take `1 - COMPILE_FUSED_FRACTION` of their eager time, bytes and kernels. Both constants are
  fitted below.
- `layer_overhead_s`: a fixed time per layer and pass (0 unless given: fitted in place of the
  per-kernel time, it left the published runs' held-out error where that one did, 9.2% against
  9.1%, and a layer's time does not grow with its kernels as the micro-batch rows' do).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import GpuSpec
from autopar.cost_models.facts import OpFacts, Unit

# A causal kernel computes the blocks on and below the diagonal: half the square torch counts.
CAUSAL_WORK_FRACTION = 0.5
# Used when neither the Efficiency nor the GPU gives one (a GPU without measured figures): the
# lent H100's bf16 8192³ matmul (790 of 989 TFLOP/s, issue #3/#6), and FlashAttention-2's A100
# middle figure taken per counted FLOP (a cautious reading).
FALLBACK_MATMUL = 0.80
FALLBACK_ATTENTION = 0.60
# Fitted on plain PyTorch steps of GPT-1.3B on the lent H100 (../shared/gpu/h100-2026-11-26.json,
# step anatomy, the dev split; the zoo model at a7ddb44, built at 50,257 and at 50,304 rows, with no
# padded-logits mask): vocabulary 50,257 against 50,304 cost 70.4 ms (foreach AdamW) and 65.1 ms
# (fused) more per step; with the head's three GEMMs priced at this fraction of the aligned efficiency
# the model gives the mean, 67.8 ms (benchmarks/gpu_rows.py --fit; 0.175 while the fit traced
# today's masked model, fifteenth session). Tested on autopar's own runs there (unpadded, a7ddb44),
# which the fit did not see.
MISALIGNED_GEMM_FACTOR = 0.180
# Fitted likewise: the anatomy's "torch.compile(model.forward)" step (the 50,304-row model, fused
# AdamW) saved 39.0 ms (331.7 -> 292.7 ms) of the 74.9 ms its compiled forward's vector ops and
# autocast's casts are priced at eager (`benchmarks/gpu_rows.py --fit`). The loss ran outside the
# compiled forward, eager, so its 14.0 ms are not in that sum (fifteenth session; 0.43 counted them,
# and priced autopar's whole-stage compile 3.1% to 7.4% slow). Tested on autopar's own compiled steps
# (benchmarks/gpu_runs/: 2fef514 on the H100, the H200 files), not seen by the fit. Those compile the
# stage whole, its loss in it, so the loss's share is an extrapolation; compile per block (blocks
# only, no fusion across them) has no measured row yet.
COMPILE_FUSED_FRACTION = 0.521


@dataclass(frozen=True)
class Efficiency:
    matmul: float | None = None  # None or 0: the GPU's measured ceiling
    attention: float | None = None  # per counted FLOP; None: from the GPU's figure (see above)
    memory: float = 0.85
    launch_overhead_s: float = 4e-6  # a bare Efficiency's; the fitted one is FITTED_EFFICIENCY's
    # A GEMM dimension of this many ridge points (the GPU's peak FLOP/s over its HBM bytes/s)
    # halves η_matmul; 0: no shape penalty.
    gemm_half_ridges: float = 0.0
    # Fixed host-side time per layer and pass (forward, backward, recompute) and micro-batch: the
    # framework's per-module work and the gaps between its kernels that launches alone miss.
    layer_overhead_s: float = 0.0
    # The ops run as torch.compile's fused kernels (set per unit by `stage_costs.Pricing.timed`).
    compiled: bool = False
    # The runtime pads the products of the linear layers `GemmShape.padding` marks (16-bit
    # precision, where the layout allows: `capabilities.gemm_padding_problem`).
    padded_gemms: bool = False
    # The runtime runs the ops under autocast over fp32 weights (`OpFacts.autocast_bytes`; set per
    # plan by `stage_costs.Pricing.timed`, from `Pricing.autocast_runs`).
    autocast: bool = False

    def matmul_for(self, gpu: GpuSpec) -> float:
        if self.matmul:
            return self.matmul
        return gpu.matmul_efficiency if gpu.matmul_efficiency is not None else FALLBACK_MATMUL

    def gemm_half_dim_for(self, gpu: GpuSpec, dtype: str) -> float:
        """The GEMM dimension that halves η_matmul on `gpu`: `gemm_half_ridges` ridge points."""
        return self.gemm_half_ridges * ridge_point(gpu, dtype)

    def attention_for(self, gpu: GpuSpec) -> float:
        """Per FLOP as torch counts a fused attention kernel's."""
        if self.attention is not None:
            return self.attention
        if gpu.attention_efficiency is None:
            return FALLBACK_ATTENTION
        return gpu.attention_efficiency / CAUSAL_WORK_FRACTION


# The two fitted constants (ninth session): fitted together on the 41 published runs, minimizing
# their MAPE (`benchmarks/validate_published.py`: matmul=0.6868, launch_overhead_s=1.351e-05,
# training MAPE 7.4%; leave-one-family-out 9.1%, the Megatron-Core H100 weak-scaling family 19%
# of it). Then held out, the one-GPU rows measured on an H100 and three H200s (`benchmarks/gpu_rows.py`),
# which this fit never saw: every row within 10% (README, ninth session). 0.687 is the efficiency the
# H200 ran the published runs' GEMMs at back to back (67.4%, `gemm_shapes.py --report`).
FITTED_EFFICIENCY = Efficiency(matmul=0.687, launch_overhead_s=13.5e-6)
DEFAULT_EFFICIENCY = FITTED_EFFICIENCY


def ridge_point(gpu: GpuSpec, dtype: str) -> float:
    """FLOPs per byte of HBM traffic at which the roofline turns from memory- to compute-bound."""
    return gpu.peak_flops_per_s(dtype) / gpu.hbm_bandwidth_bytes_per_s


def gemm_efficiency(dims: tuple[float, float, float, float], ceiling: float, half_dim: float) -> float:
    """η of a batched GEMM (count, m, n, k) on one rank: the ceiling, lowered by every dimension
    that is small next to `half_dim` (d/(d + half_dim) each); monotone in each dimension."""
    if half_dim <= 0:
        return ceiling
    factor = 1.0
    for d in dims[1:]:
        factor *= d / (d + half_dim)
    return ceiling * factor


def op_time_s(op: OpFacts, gpu: GpuSpec, dtype: str, *, batch: int, tp: int, sp: bool,
              efficiency: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """One op for a micro-batch of `batch` samples on one of `tp` tensor-parallel ranks."""
    if op.kind == "view":
        return 0.0
    divide = tp if (op.tp_sharded or (sp and op.kind == "vector")) else 1
    flops = op.flops * batch / divide
    bandwidth = gpu.hbm_bandwidth_bytes_per_s * efficiency.memory
    fused = 1 - COMPILE_FUSED_FRACTION if efficiency.compiled else 1.0
    autocast = efficiency.autocast and op.autocast_bytes is not None
    activation_bytes = op.autocast_bytes if autocast and op.kind == "vector" else op.activation_bytes
    memory_time = (activation_bytes * batch + op.weight_bytes) / divide / bandwidth
    if op.kind == "vector":  # compiled: the fused share is gone as kernels, launches included
        if autocast and op.autocast_kernels == 0:
            return 0.0  # a cast to the dtype the tensor has under autocast: no kernel
        return (memory_time + efficiency.launch_overhead_s) * fused
    # pad copies and autocast's casts of the inputs: kernels of their own, run before the product, not under it
    copy_time = input_casts_s(op, gpu, batch=batch, tp=tp, efficiency=efficiency)
    if op.kind == "attention":
        compute_time = flops / (gpu.peak_flops_per_s(dtype) * efficiency.attention_for(gpu))
    else:
        ceiling = efficiency.matmul_for(gpu)
        class_efficiency = ceiling
        if op.gemm is not None:
            dims = op.gemm.at(batch, tp if op.tp_sharded else 1)
            class_efficiency = gemm_efficiency(dims, ceiling, efficiency.gemm_half_dim_for(gpu, dtype))
            sixteen_bit = dtype in ("bf16", "fp16")
            misaligned = sixteen_bit and any(d % 8 for d in dims[1:])
            # the runtime pads the layer, or inductor pads the product's operands (shape_padding); the
            # copies are counted for the whole layer (`padding_copy_bytes`), so not for a tp shard
            inductor_pads = efficiency.compiled and misaligned and (tp == 1 or not op.tp_sharded)
            padded = op.gemm.padding is not None and (efficiency.padded_gemms or inductor_pads)
            if padded:
                copy_time += padding_copy_bytes(op, dims) / bandwidth
            elif misaligned and not efficiency.compiled:
                class_efficiency *= MISALIGNED_GEMM_FACTOR
        compute_time = flops / (gpu.peak_flops_per_s(dtype) * class_efficiency)
    return max(compute_time, memory_time) + copy_time + efficiency.launch_overhead_s


def input_casts_s(op: OpFacts, gpu: GpuSpec, *, batch: float, tp: int, efficiency: Efficiency) -> float:
    """A GEMM's or attention's casts of its fp32 inputs to 16 bits under autocast (`OpFacts.autocast_bytes`):
    memory-bound kernels of their own; inductor fuses them like other vector ops. No per-kernel time
    of their own: autocast dispatches them inside their product's op, whose per-kernel time (fitted
    per traced op, host dispatch included) already holds them; priced one each, the micro-batch
    rows (many small casts) went 5 points over."""
    if op.kind not in ("matmul", "attention") or not efficiency.autocast or not op.autocast_bytes:
        return 0.0
    fused = 1 - COMPILE_FUSED_FRACTION if efficiency.compiled else 1.0
    divide = tp if op.tp_sharded else 1
    return op.autocast_bytes * batch / divide / (gpu.hbm_bandwidth_bytes_per_s * efficiency.memory) * fused


def padding_copy_bytes(op: OpFacts, dims: tuple[float, float, float, float]) -> float:
    """What the runtime's padding of a linear layer copies (`runtime/gemm_padding.py`), charged to
    the product that waits for it: the forward pads the weight (read and written, fp32 at most: 8
    bytes per padded element); the input gradient's product pads the output gradient it receives
    (16-bit, read and written: 4 bytes per padded element); the weight gradient's reuses that one."""
    width, padded = op.gemm.padding
    if op.phase == "forward":
        others = [d for i, d in enumerate(dims[1:], start=1) if i != op.gemm.scaled and d != width]
        return 8.0 * padded * (others[0] if others else 0.0)
    if op.weight_gradient:
        return 0.0
    return 4.0 * padded * dims[op.gemm.scaled]


def unit_fixed_overhead_s(unit: Unit, efficiency: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """A layer's fixed host-side time per micro-batch, forward and backward together (half each):
    the same whatever its sharding, so the intra-op ILP adds it to its objective unchanged."""
    return 2 * efficiency.layer_overhead_s if unit.layer_type is not None else 0.0


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
    forward_matmul_s: float = 0.0  # the GEMMs' part: what overlapped tp collectives hide behind
    backward_matmul_s: float = 0.0
    backward_weight_s: float = 0.0  # the weight-gradient GEMMs (`OpFacts.weight_gradient`)


def unit_time(unit: Unit, gpu: GpuSpec, dtype: str, *, batch: float, tp: int, sp: bool,
              efficiency: Efficiency = DEFAULT_EFFICIENCY, share: float = 1.0) -> UnitTime:
    """`batch`: sequences' worth of positions one rank runs; `share`: its share of each sequence's
    positions (1/cp), for the reductions of position-table lookups (`OpFacts.reduce_bytes_for`)."""
    def total(ops, kinds=None) -> float:
        return sum(op_time_s(op, gpu, dtype, batch=batch, tp=tp, sp=sp, efficiency=efficiency)
                   for op in ops if kinds is None or op.kind in kinds)

    def casts(ops) -> float:
        return sum(input_casts_s(op, gpu, batch=batch, tp=tp, efficiency=efficiency) for op in ops if op.kind == "matmul")

    forward_reduce = [op.reduce_bytes_for(batch, share) for op in unit.forward_ops if op.reduce_bytes]
    backward_reduce = [op.reduce_bytes_for(batch, share) for op in unit.backward_ops if op.reduce_bytes]
    overhead = unit_fixed_overhead_s(unit, efficiency) / 2
    return UnitTime(
        forward_s=total(unit.forward_ops) + overhead,
        backward_s=total(unit.backward_ops) + overhead,
        # what selective recompute repeats: the vector ops, and the casts of the GEMMs' inputs they feed
        forward_vector_s=total(unit.forward_ops, {"vector"}) + casts(unit.forward_ops),
        forward_reduce_bytes=sum(forward_reduce),
        backward_reduce_bytes=sum(backward_reduce),
        forward_reduces=len(forward_reduce),
        backward_reduces=len(backward_reduce),
        forward_collectives=tuple((kind, size * batch) for op in unit.forward_ops for kind, size in op.collectives),
        backward_collectives=tuple((kind, size * batch) for op in unit.backward_ops for kind, size in op.collectives),
        # the GEMMs alone (what overlapped tp collectives hide behind; the zero-bubble W pass): no casts
        forward_matmul_s=total(unit.forward_ops, {"matmul"}) - casts(unit.forward_ops),
        backward_matmul_s=total(unit.backward_ops, {"matmul"}) - casts(unit.backward_ops),
        backward_weight_s=sum(op_time_s(op, gpu, dtype, batch=batch, tp=tp, sp=sp, efficiency=efficiency)
                              - input_casts_s(op, gpu, batch=batch, tp=tp, efficiency=efficiency)
                              for op in unit.backward_ops if op.weight_gradient),
    )
