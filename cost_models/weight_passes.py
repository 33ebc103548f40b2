"""Passes over a stage's weights that each micro-batch makes outside its GEMMs, as autopar's
runtime makes them.

Mixed precision in the runtime is autocast over fp32 weights (`memory.autocast_states`):
- each micro-batch's forward casts every weight to 16 bits: read 4 B, write 2 B per parameter,
  and again in the recompute of a recomputed layer, full or selective (the cast cache lives only
  inside the forward's autocast region, and selective recompute saves GEMM outputs, not the casts:
  `runtime.recompute`). With pipeline stages the runtime runs the whole schedule in one autocast
  region (`ParallelModel.forward_backward`), so without recompute the forward casts once per step,
  a 1/n share per micro-batch (`_casts_once_per_step`). With recompute each checkpoint's recompute
  enters and leaves autocast again (on CUDA on autograd's device thread), and leaving it may clear
  the cast cache the forward relies on (torch's cache is shared across threads, the nesting that
  clears it is per thread): not measured, so that case keeps a cast per micro-batch;
- its backward casts each weight's 16-bit gradient back to fp32: read 2 B, write 4 B.

From the second micro-batch on, autograd adds each new gradient into the one held (AccumulateGrad):
it reads two gradients and writes one, 3 × the accumulated element per parameter. The element is
fp32 under autocast and where FSDP2 accumulates in its reduction dtype (ZeRO 3), the compute
precision otherwise. Where gradients are reduce-scattered every micro-batch
(`memory.gradients_sharded`), only the dp shard accumulates. The first micro-batch has nothing to
add to, so a stage's micro-batch carries (n − 1)/n of the pass on average.

Every pass is bound by memory, so it is priced on the HBM roofline (`compute.Efficiency.memory`).
Measured on one H200 (benchmarks/gpu_diagnose.py at af063d4, GPT-1.3B, 1.32e9 parameters): the
accumulation took 3.9 ms per micro-batch (15.8 GB: 4.05 TB/s); the weight casts 2.4 ms and the
gradient casts 4.5 ms per micro-batch. Together they were the eager micro-batch rows' missing time
(`benchmarks/gpu_rows.py`).

`weight_passes=false` (`cost_models.implementation`) prices software that holds 16-bit model
weights beside fp32 master weights (no per-micro-batch cast) and accumulates into an fp32 main
gradient inside the weight-gradient GEMM: Megatron-LM's gradient-accumulation fusion
(on by default in Megatron-LM's arguments; `--no-gradient-accumulation-fusion` turns it off). The
published rows are priced so (`benchmarks/published_runs.py`); Megatron-LM's 2021 runs added each
16-bit gradient into the fp32 main gradient in a hook instead, a pass this leaves unpriced.
"""

from __future__ import annotations

from autopar.cost_models.context import replicas
from autopar.cost_models.memory import autocast_states, gradients_sharded

CAST_FORWARD_BYTES = 4 + 2  # read the fp32 weight, write its 16-bit copy
CAST_BACKWARD_BYTES = 2 + 4  # read the 16-bit gradient, write it in fp32


def accumulated_element_bytes(precision: str, zero: int, offload: str, optimizer_state: str) -> int:
    """Bytes of one accumulated gradient element: fp32 under autocast (fp32 weights), under FSDP2's
    fp32 reduction dtype (ZeRO 3) and in fp32 training; the compute precision otherwise."""
    if precision == "fp32" or zero >= 3 or autocast_states(precision, zero, offload, optimizer_state):
        return 4
    return 2


def weight_pass_bytes(params: float, recomputed_params: float, strategy, precision: str) -> tuple[float, float]:
    """(forward, backward) bytes one micro-batch moves over a stage's `params` (tp-local) outside the
    GEMMs; `recomputed_params`: those of recomputed layers, whose recompute casts again (its
    bytes are in the backward, where the recompute runs)."""
    s = strategy
    if not s.weight_passes:
        return 0.0, 0.0
    forward = backward = 0.0
    if autocast_states(precision, s.zero, s.offload, s.optimizer_state):
        forward = CAST_FORWARD_BYTES * params / (s.num_microbatches if _casts_once_per_step(s) else 1)
        backward = CAST_BACKWARD_BYTES * params + CAST_FORWARD_BYTES * recomputed_params
    if s.num_microbatches > 1:
        shards = replicas(s) if gradients_sharded(s.zero, s.pp) else 1
        element = accumulated_element_bytes(precision, s.zero, s.offload, s.optimizer_state)
        backward += 3 * element * params / shards * (s.num_microbatches - 1) / s.num_microbatches
    return forward, backward


def _casts_once_per_step(strategy) -> bool:
    """Pipeline stages without recompute: one autocast region holds the step's forwards, and
    nothing leaves autocast before the step ends, so each weight is cast once (tested on CPU,
    `tests/test_gpu_cost_terms.py`)."""
    recomputes = strategy.recompute != "none" and any(strategy.recompute_layers or (1,))
    return strategy.pp > 1 and not recomputes
