"""Peak memory of one device: model states by ZeRO stage, activations by recompute policy and
in-flight micro-batches, communication buffers, and an allocator margin.

Model states per parameter (Rajbhandari et al., "ZeRO", SC'20, §3.1 and §5): mixed-precision
Adam holds a 2-byte weight, a 2-byte gradient and 12 bytes of fp32 master weight and moments;
fp32 training holds 4 + 4 + 8. ZeRO-1 shards the optimizer states over dp, ZeRO-2 also the
gradients, ZeRO-3 also the weights (under pipeline stages not the gradients: `gradients_sharded`).

What this model gets wrong (issue #18; issue #29 checked the unsharded case on an H100 and against
torch's MemTracker, `_unsharded_peak`):
- Sequence length: activations are the traced graph's saved tensors, linear in s with fused
  attention (s² with `attention=math`), which matches Korthikanti et al. 2022 (32·s·h per layer and
  sample at tp=1, 4·s·h with tp=8 and sp, vs their 34 and 4.25 with dropout masks). The backward's
  transient gradients: the head's (two fp32 logits-sized gradients, one in the logits' dtype for a
  stage compiled whole) on the last stage (`backward_memory.loss_gradient_bytes`); a layer's in flight (the
  stream's and its largest saved tensor's) with an accumulated weight's fresh gradient, beside what
  recompute rebuilds for it, on any stage (`backward_memory.backward_working_bytes`); the larger counts.
- Tensor parallelism: the head's saved logits are counted vocabulary-parallel (divided by tp), as
  Megatron-LM runs them; autopar's runtime gathers them on a pipeline's last stage, which keeps them
  whole (`stage_costs.last_stage_kept_bytes`: pp = 2 × tp = 2 measured 0.925 of the model before, 0.997
  since). The loss's gradients follow the runtime's layout (`LossLayout`). A vocabulary-parallel
  embedding's backward makes its whole table's gradient (`backward_memory.lookup_gradient_bytes`). Without sp, the replicated norm inputs are kept whole on
  each tp rank (counted).
- Pipeline stages (`benchmarks/rank_memory_cases.py`, CPU/gloo, tiny shapes) measured within −2.0% and
  +15% of their prediction once the last stage's kept logits (`stage_costs.last_stage_kept_bytes`) and
  the backward's working set (`backward_memory.backward_working_bytes`) were counted: 1F1B within 0.2%,
  pp × tp's first stage 10–14% over (two whole-table gradients beside every gradient), GPipe's
  first stage 15% over (its most micro-batches in flight come before any gradient exists; priced together);
  full and selective recompute of 1,024-position stages 1.1-1.8% over.
- Gradients are held at the compute precision (2 bytes); Megatron-LM accumulates them in an fp32
  buffer (4 bytes), so its runs hold 2 bytes per parameter more than predicted here.
- The fragmentation margin under ZeRO and the CUDA/NCCL reserve are nominal (below); without ZeRO the
  allocator's slack is measured (`UNSHARDED_ALLOCATOR_SLACK`).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_models.compiled_stage import COMPILED_ACTIVATION_FACTOR, COMPILED_FP32_ACTIVATION_FACTOR
from autopar.cost_models.optimizer import temporary_bytes_per_param

# PyTorch DDP's default gradient bucket (bucket_cap_mb=25); two are in flight while overlapping.
DDP_BUCKET_BYTES = 25 * 2**20
# Nominal allocator fragmentation margin and CUDA context + NCCL reserve, until GPU validation
# (issue #4, item 7) measures them: a plan must leave this much of the device free. The margin
# is charged on what the caching allocator churns, activations and communication buffers
# allocated and freed every micro-batch in blocks of varying size; model states are allocated
# once, in large long-lived blocks (FSDP2's flat shards, Megatron-LM's contiguous gradient
# buffer), and fragment little.
FRAGMENTATION_MARGIN = 0.05
# Autocast over fp32 weights (the runtime without ZeRO) keeps more per layer than the bf16 trace: the
# norms' fp32 inputs and the per-consumer bf16 casts of their outputs. Counted op by op from each model's
# graph where the facts carry the count (`OpFacts.autocast_saved_bytes`, `Unit.autocast_input_bytes`:
# the zoo GPT keeps 1.25 of its traced bytes without recompute, Llama 1.04). Where they do not (facts
# built by hand, Megatron-LM's 16-bit weights priced as a what-if), the GPT's ratio, the larger,
# measured with MemTracker on fake tensors (`benchmarks/memory_tracker_shapes.py`: 40 against 32 bytes
# per token and hidden unit per layer), applied to the traced bytes.
AUTOCAST_ACTIVATION_FACTOR = 40 / 32
# The caching allocator's reserve beyond what tensors hold, without ZeRO (the runtime's one-GPU and dp
# plans, under the expandable segments it sets: `runtime/allocator.py`), as a fraction of what they hold:
# the largest max_memory_reserved / max_memory_allocated − 1 of the runtime's own one-GPU H200 rows
# (benchmarks/gpu_runs/, 16 cases; `python benchmarks/gpu_rows.py --fit`). It is 0.1–0.8% without
# recompute, and 3.0–6.4% where the step frees and re-allocates blocks of changing size (recompute, a
# misaligned vocabulary, Llama); GPT-1.3B with full recompute at micro-batch 16 sets it. Held out
# case by case, the worst case reserves 0.4% more than the others allow, and held out as a family (every
# full-recompute case) 0.8%. It replaces a margin of 0.20 on the churned bytes (activations and
# transients), fitted on the shared H100 rows under the default allocator, which left GPT-2.7B with
# full recompute 6% under when held out and over-predicted the other rows by 6.5–18%.
UNSHARDED_ALLOCATOR_SLACK = 0.0642
RESERVED_BYTES = 2 * 2**30
# Under offload FSDP2 gathers a unit from its fp32 host shard: the shard is first copied to the device
# whole (4 bytes per parameter), then cast to the compute dtype (2) for the all-gather
# (`FSDPParam.all_gather_inputs`, torch 2.11), both on the all-gather's copy-in stream and freed once
# copied in. The caching allocator keeps their blocks in that stream's pool, beside the gathered
# copies counted below, so the reserve holds them through the step. On the lent H200 (0621687,
# GPT-2.7B ZeRO-3, expandable segments) the offload row reserved 7.0 GiB against 6.75 predicted
# without them (3.3% under).
OFFLOAD_STAGING_BYTES_PER_PARAM = 4 + 2


@dataclass(frozen=True)
class StateBytes:
    weight: int
    gradient: int
    optimizer: int  # fp32 master (mixed precision) + two Adam moments


def state_bytes_per_param(precision: str, optimizer_state: str = "fp32") -> StateBytes:
    """`optimizer_state="bf16"`: Adam's two moments in bf16 beside the fp32 master weights
    (e.g. Megatron-Core's --exp-avg-dtype/--exp-avg-sq-dtype bf16): 4 + 2 + 2 bytes."""
    moments = 4 if optimizer_state == "bf16" else 8
    if precision == "fp32":
        return StateBytes(weight=4, gradient=4, optimizer=moments)
    return StateBytes(weight=2, gradient=2, optimizer=4 + moments)


@dataclass(frozen=True)
class MemoryBreakdown:
    parameters: float
    gradients: float
    optimizer_states: float
    activations: float
    buffers: float
    margin: float

    @property
    def total_bytes(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states + self.activations + self.buffers + self.margin

    def as_dict(self) -> dict[str, float]:
        return {
            "parameters": self.parameters, "gradients": self.gradients, "optimizer_states": self.optimizer_states,
            "activations": self.activations, "buffers": self.buffers, "margin": self.margin,
        }


def gradients_sharded(zero: int, pp: int) -> bool:
    """Whether only gradient shards persist through the step, reduce-scattered every micro-batch: ZeRO 2,
    and ZeRO 3 without pipeline stages. Under pipeline stages ZeRO 3 accumulates them whole and
    reduce-scatters once per step, as TorchTitan composes FSDP2 with its pipeline (its weights
    re-gathered per use, `runtime.pipeline.zero_stage`)."""
    return zero == 2 or (zero >= 3 and pp == 1)


def model_state_bytes(params_on_device: float, precision: str, zero: int, dp: int,
                      optimizer_state: str = "fp32", pp: int = 1,
                      num_microbatches: int = 1) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) held by one device for its share of parameters.

    ZeRO 1-3 run on FSDP2 with fp32 gradient reduction (`runtime.precision.fsdp_policy`), so a
    gradient kept is fp32 whatever the compute precision: the reduced shards (4 B / dp, the dtype of
    the fp32 master shard), and, where micro-batches accumulate before one reduction (ZeRO 1, ZeRO 3
    under pipeline stages), the whole gradient, which FSDP2 accumulates in the reduction dtype
    (`FSDPParam.to_accumulated_grad_if_needed`): 4 B. With one micro-batch each unit's gradient is
    reduced as its backward ends, so only shards persist."""
    per = state_bytes_per_param(precision, optimizer_state)
    weights = params_on_device * per.weight / (dp if zero >= 3 else 1)
    if zero == 0:
        gradients = params_on_device * per.gradient
    elif gradients_sharded(zero, pp) or num_microbatches == 1:
        gradients = params_on_device * 4 / dp
    else:
        gradients = params_on_device * 4
    optimizer = params_on_device * per.optimizer / (dp if zero >= 1 else 1)
    return weights, gradients, optimizer


def device_memory(
    *,
    params_on_device: float,
    largest_unit_params: float,
    precision: str,
    zero: int,
    dp: int,
    activation_bytes: float,
    optimizer_state: str = "fp32",
    offload: str = "none",
    dispatch_bytes: float = 0.0,
    expert_params: float = 0.0,
    expert_dp: int = 1,
    exchange_bytes: float = 0.0,
    num_microbatches: int = 1,
    optimizer_impl: str = "fused",
    loss_bytes: float = 0.0,
    pp: int = 1,
    compiled: bool = False,
    autocast_counted: bool = False,
) -> MemoryBreakdown:
    """`offload="optimizer"` (FSDP2's CPUOffloadPolicy): every sharded state lives in host memory
    (`cost_models.offload`): the optimizer states (fp32 master weights and moments) always, the
    gradient shards under ZeRO 2/3 (reduced every micro-batch, then copied out) and the weight
    shards under ZeRO 3 (gathered from the host for each use: the buffers below). What the runtime
    keeps unsharded through the step stays: ZeRO 1/2's gathered weights, ZeRO 1's gradients.
    `expert_params` (ep > 1): of `params_on_device`, this rank's expert slices, whose ZeRO shards
    over their `expert_dp` = dp/ep replicas (`cost_models.experts`). `pp`: under pipeline stages
    ZeRO 3 holds whole gradients (`gradients_sharded`). `compiled`: the stage compiled whole without
    recompute, whose activations min-cut partitions (`cost_models.compiled_stage`). `autocast_counted`:
    `activation_bytes` are at autocast's dtypes already (`stage_costs.autocast_activations`)."""
    dense = model_state_bytes(params_on_device - expert_params, precision, zero, dp, optimizer_state, pp,
                              num_microbatches)
    sliced = model_state_bytes(expert_params, precision, zero, expert_dp, optimizer_state, pp, num_microbatches)
    weights, gradients, optimizer = (a + b for a, b in zip(dense, sliced))
    if offload == "optimizer":
        optimizer = 0.0
        gradients = 0.0 if zero >= 2 else gradients
        weights = 0.0 if zero >= 3 else weights
    per = state_bytes_per_param(precision, optimizer_state)
    if zero >= 3:  # the gathered unit (or tensor, zero3_fetch=parameter) in use and the next one prefetched
        buffers = 2 * largest_unit_params * per.weight
        if offload == "optimizer":  # the prefetched unit's fp32 host shard copied in, and its cast
            buffers += largest_unit_params / dp * OFFLOAD_STAGING_BYTES_PER_PARAM
    elif dp > 1:
        buffers = 2 * DDP_BUCKET_BYTES
    else:
        buffers = 0.0
    buffers += dispatch_bytes  # ep: one MoE all-to-all's send and receive buffers
    buffers += exchange_bytes  # cp: the attention exchange's blocks in flight (`cost_models.context`)
    if unsharded_states(zero, offload, optimizer_state):
        return _unsharded_peak(params_on_device, activation_bytes, buffers, loss_bytes, num_microbatches,
                               optimizer_impl, autocast_states(precision, zero, offload, optimizer_state), compiled,
                               autocast_counted)
    buffers += loss_bytes  # the backward past the transient: the head's gradients or a unit's (`evaluate.rank_memory`)
    return MemoryBreakdown(
        parameters=weights, gradients=gradients, optimizer_states=optimizer, activations=activation_bytes,
        buffers=buffers, margin=FRAGMENTATION_MARGIN * (activation_bytes + buffers),
    )


def autocast_states(precision: str, zero: int, offload: str, optimizer_state: str) -> bool:
    """Whether the runtime runs this plan as autocast over whole fp32 weights (`_unsharded_peak`)."""
    return precision != "fp32" and unsharded_states(zero, offload, optimizer_state)


def runs_autocast(strategy, precision: str) -> bool:
    """Whether the ops run under autocast over fp32 weights (`OpFacts.autocast_bytes`): ZeRO 0, no
    offload, 16-bit compute, as the runtime runs it (not `weight_passes=false`: 16-bit weights)."""
    s = strategy
    return s.weight_passes and autocast_states(precision, s.zero, s.offload, s.optimizer_state)


def unsharded_states(zero: int, offload: str, optimizer_state: str) -> bool:
    """Whether the runtime holds this plan's states whole, in fp32 (`_unsharded_peak`)."""
    return zero == 0 and offload == "none" and optimizer_state == "fp32"


def activation_factor(precision: str, zero: int, offload: str, optimizer_state: str, compiled: bool = False,
                      autocast_counted: bool = False) -> float:
    """Stored bytes per byte of the activations priced: autocast's extra, where it runs and the
    activations were not counted at its dtypes (`autocast_counted`: 1, else `AUTOCAST_ACTIVATION_FACTOR`
    on the traced bytes); a stage compiled whole keeps what inductor's min-cut partition saves instead
    (`cost_models.compiled_stage`)."""
    if not autocast_states(precision, zero, offload, optimizer_state):
        return COMPILED_FP32_ACTIVATION_FACTOR if compiled and unsharded_states(zero, offload, optimizer_state) else 1.0
    if compiled:
        return COMPILED_ACTIVATION_FACTOR
    return 1.0 if autocast_counted else AUTOCAST_ACTIVATION_FACTOR


def fragmentation(zero: int, offload: str, optimizer_state: str) -> float:
    """The allocator's margin per byte of activations: the slack on all held bytes where states are whole
    (`UNSHARDED_ALLOCATOR_SLACK`), else the nominal margin on the churned bytes."""
    return UNSHARDED_ALLOCATOR_SLACK if unsharded_states(zero, offload, optimizer_state) else FRAGMENTATION_MARGIN


def activation_scale(precision: str, zero: int, offload: str, optimizer_state: str, compiled: bool = False,
                     autocast_counted: bool = False) -> float:
    """Device bytes per byte of the activations priced: autocast's extra and the allocator's margin."""
    return (activation_factor(precision, zero, offload, optimizer_state, compiled, autocast_counted)
            * (1 + fragmentation(zero, offload, optimizer_state)))


def storage_bytes(memory: MemoryBreakdown, factor: float) -> float:
    """A peak less the allocator's margin: tensor storage alone, what torch's MemTracker counts.
    `factor`: `activation_factor` of the plan (autocast's extra stays in)."""
    return (memory.parameters + memory.gradients + memory.optimizer_states + memory.buffers
            + memory.activations * factor)


def _unsharded_peak(params: float, activation_bytes: float, buffers: float, loss_bytes: float,
                    num_microbatches: int, optimizer_impl: str, autocast: bool,
                    compiled: bool = False, autocast_counted: bool = False) -> MemoryBreakdown:
    """Without ZeRO the runtime holds fp32 weights, and mixed precision is autocast over them. Measured
    with torch's MemTracker on fake tensors (`profiler/memory_tracker.py`, within ~1% of an H100's
    max_memory_allocated on GPT-1.3B), the step has two peaks:
    - backward, at the head of the last micro-batch: fp32 weights (4 B) and, under autocast, their
      bf16 copies (2 B, from the forward to each linear's backward), the moments (8 B), fp32 gradients
      (4 B) only when earlier micro-batches accumulated them, the activations and the loss's gradients;
    - the optimizer step: weights, gradients and moments (16 B) and the implementation's temporaries
      (`cost_models.optimizer`: 4 B for foreach).
    The larger is the peak (per parameter: 14 or 18 B beside the activations, or 16 B + temporaries).
    Activations are the graph's: under autocast the residual stream stays fp32 and each linear casts its
    input apart, so they hold more than the 16-bit trace, counted op by op where `autocast_counted`
    (`stage_costs.autocast_activations`), else the traced bytes times `AUTOCAST_ACTIVATION_FACTOR`.
    The extra is counted in the margin, beside the allocator's slack on all of it
    (`UNSHARDED_ALLOCATOR_SLACK`), so the activations stay the graph's and `activation_scale` is the one
    ratio from them to the peak (what recompute counts save)."""
    factor = activation_factor("bf16" if autocast else "fp32", 0, "none", "fp32", compiled, autocast_counted)
    slack = UNSHARDED_ALLOCATOR_SLACK
    weights, gradients, moments = _backward_state_bytes_per_param(autocast, num_microbatches)
    states = (weights + gradients + moments) * params
    held = states + factor * activation_bytes + buffers + loss_bytes
    backward = MemoryBreakdown(parameters=weights * params, gradients=gradients * params,
                               optimizer_states=moments * params, activations=activation_bytes,
                               buffers=buffers + loss_bytes, margin=(factor - 1) * activation_bytes + slack * held)
    step_states = _step_state_bytes_per_param(optimizer_impl) * params
    step = MemoryBreakdown(parameters=4 * params, gradients=4 * params,
                           optimizer_states=(8 + temporary_bytes_per_param(optimizer_impl)) * params,
                           activations=0.0, buffers=buffers, margin=slack * (step_states + buffers))
    return max(backward, step, key=lambda part: part.total_bytes)


def _backward_state_bytes_per_param(autocast: bool, num_microbatches: int) -> tuple[int, int, int]:
    """(weights, gradients, moments) per parameter at `_unsharded_peak`'s backward peak: fp32 weights and,
    under autocast, their bf16 copies; fp32 gradients where earlier micro-batches accumulated them."""
    return (6 if autocast else 4), (4 if num_microbatches > 1 else 0), 8


def _step_state_bytes_per_param(optimizer_impl: str) -> float:
    """Per parameter at `_unsharded_peak`'s optimizer step: weights, gradients, moments, temporaries."""
    return 16 + temporary_bytes_per_param(optimizer_impl)


def unsharded_state_bytes_per_param(autocast: bool, num_microbatches: int, optimizer_impl: str) -> float:
    """The bytes per parameter a plan without ZeRO holds at the larger of its two peaks, activations
    aside (`_unsharded_peak`): what the intra-op ILP's memory row charges a weight (`searcher.memory_budget`)."""
    return max(sum(_backward_state_bytes_per_param(autocast, num_microbatches)), _step_state_bytes_per_param(optimizer_impl))


def usable_bytes(memory_bytes: float) -> float:
    return memory_bytes - RESERVED_BYTES


def planning_capacity_bytes(memory_bytes: float, headroom: float) -> float:
    """What a plan's predicted peak may reach: usable memory less the planner's headroom, a
    fraction of it (`autopar.cluster.DEFAULT_MEMORY_HEADROOM`)."""
    return usable_bytes(memory_bytes) * (1 - headroom)


@dataclass(frozen=True)
class LossLayout:
    """How the runtime runs the loss on the last stage (`runtime.parallelize`): on vocabulary shards, under
    `loss_parallel`, where the head is vocabulary-parallel at pp = 1 (module rules and DTensor alike:
    DTensor's logits not sharded over the vocabulary reach the loss as plain tensors). Elsewhere (a tp
    head kept replicated, logits gathered for a pipeline's last stage) every tp rank holds the whole
    logits. Until the loss's layout was priced, its logits counted divided by tp at any pp = 1: a GPT at
    tp = 2 with its head replicated held 40% more than priced (the CPU allocator's events, 6f7d45a)."""

    vocab_parallel: bool = False

    @property
    def loss_parallel(self) -> bool:
        return self.vocab_parallel

    @staticmethod
    def of(s, vocab: int | None, vocab_parallel: bool | None = None) -> LossLayout:
        """`vocab_parallel`: whether the head's logits come out sharded (a dry run's placements say; None:
        where `vocab` is given, the analytic layouts' sign of a vocabulary-parallel head)."""
        if vocab_parallel is None:
            vocab_parallel = vocab is not None
        return LossLayout(bool(vocab_parallel) and s.tp > 1 and s.pp == 1)
