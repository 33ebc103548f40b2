"""How a run is implemented, as far as its cost goes: the knobs `--strategy` accepts beyond the
parallel layout, so a hand-written or published configuration can be priced as it ran.

The defaults are autopar's runtime (`RUNTIME_PROFILE`); the runtime runs nothing else but the
alternatives `autopar.capabilities.RUNTIME_ALTERNATIVES` lists (which the searcher chooses where they
pay), the searcher never chooses another, and a user who fixes one gets a what-if price. The knobs,
with what the cost model does with each:
- `attention=math`: attention with its scores materialized (Megatron-LM before FlashAttention,
  2022): each fused attention op of the graph is priced as the kernels such software runs, two
  batched GEMMs and a softmax (and an attention dropout) forward, four GEMMs and their backward
  passes, saving the softmax output; the graph's own ops stay untouched (`as_run`).
- `dropout=p`: Megatron-LM's dropout sites on a graph traced without them: after the embedding,
  after attention and after the MLP (a mask saved per element), and on the attention
  probabilities (fused into a flash kernel, so priced only with `attention=math`).
- `dp_overlap=false`: data-parallel gradient reduction after the last backward and ZeRO weight
  gathers not overlapped with compute (Megatron-LM's 2021 local DDP; 2021 ZeRO-3 implementations).
- `tp_overlap=true`: tensor-parallel collectives overlapped with the GEMMs beside them
  (Transformer Engine's userbuffers, Megatron-Core's --tp-comm-overlap; needs sp).
- `optimizer_state=bf16`: Adam moments in bf16 beside fp32 master weights (8 bytes per
  parameter instead of 12).
- `zero3_fetch=parameter`: ZeRO-3 as DeepSpeed 0.3 (2021, the ZeRO-3 of Megatron-LM's SC'21 comparison)
  ran it: each module's own parameters fetched before it runs with one all-gather per parameter
  tensor, each call preceded by a device synchronize, and the module waiting for them
  (deepspeed/runtime/zero/stage3.py `fetch_sub_module` and partition_parameters.py
  `_allgather_param` at v0.3.14, April 2021). So every tensor pays its own collective's latency,
  which grows with the ranks of a flat ring, none of it overlaps compute, and a recomputed
  forward fetches again; the device holds a module's tensors at a time, not a layer's
  (`cost_models.stage_costs`, `cost_models.memory`).
- `optimizer_impl=foreach`: torch's default AdamW (multi-tensor passes, a temporary the size of the
  moments) instead of the runtime's fused kernel (`cost_models.optimizer`); `optimizer_impl=apex`:
  a fused kernel with the clip's scaling as a pass of its own (apex's FusedAdam: Megatron-LM, DeepSpeed).
- `gemm_padding=false`: misaligned 16-bit linear layers run at their own width, on the fallback
  kernel (`cost_models.compute`), as the runtime did before it padded them (a7ddb44).
- `weight_passes=false`: no per-micro-batch passes over the weights outside the GEMMs: 16-bit
  model weights, the gradient accumulation fused into the weight-gradient GEMM (Megatron-LM;
  `cost_models.weight_passes`).
- `sp_inputs=shards`: under sequence parallelism a column-parallel projection keeps its input's
  sequence shard and gathers it again in backward, overlapped with the input gradient (Megatron-LM;
  Korthikanti et al. 2022, §4.2.2), where the runtime's keep the gathered tensor
  (`OpFacts.gathered_bytes`) or, with `sp_inputs=regathered` (a runtime alternative), keep the shard
  in the layers they do not recompute and gather it again when backward reaches the block, one
  all-gather more per block and micro-batch, not overlapped (`collectives.regathered_inputs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from autopar.capabilities import RUNTIME_ALTERNATIVES
from autopar.errors import AutoparError
from autopar.cost_models.facts import GemmShape, ModelFacts, OpFacts

RUNTIME_PROFILE: dict[str, Any] = {"attention": "fused", "dropout": 0.0, "dp_overlap": True, "tp_overlap": False,
                                   "optimizer_state": "fp32", "zero3_fetch": "unit", "optimizer_impl": "fused",
                                   "gemm_padding": True, "weight_passes": True, "sp_inputs": "gathered"}
PROFILE_KEYS = tuple(RUNTIME_PROFILE)
_MASK_BYTES = 1  # a dropout mask: one bool per element
_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def profile_of(strategy_or_fixed: Any) -> dict[str, Any]:
    """The implementation knobs of a Strategy, or of `--strategy`'s fixed keys (defaults filled in)."""
    if isinstance(strategy_or_fixed, Mapping):
        return {key: strategy_or_fixed.get(key, default) for key, default in RUNTIME_PROFILE.items()}
    return {key: getattr(strategy_or_fixed, key) for key in PROFILE_KEYS}




def is_runtime_profile(strategy_or_fixed: Any) -> bool:
    """Whether every knob is one the runtime runs (its default, or an alternative it also runs)."""
    profile = profile_of(strategy_or_fixed)
    return all(value == RUNTIME_PROFILE[key] or value in RUNTIME_ALTERNATIVES.get(key, ())
               for key, value in profile.items())


def as_run(facts: ModelFacts, attention: str = "fused", dropout: float = 0.0) -> ModelFacts:
    """`facts` with its units priced as software with `attention` and `dropout` runs them (see the
    module docstring); the facts themselves when nothing changes. Marked, so applying the same
    profile twice changes nothing."""
    key = (attention, dropout)
    if facts.extra.get("implementation", ("fused", 0.0)) == key:
        return facts
    if facts.extra.get("implementation", ("fused", 0.0)) != ("fused", 0.0):
        raise ValueError(f"facts already priced as {facts.extra['implementation']}, cannot re-price as {key}")
    has_dropout = any(op.name.startswith("native_dropout") for unit in facts.units for op in unit.ops)
    if dropout and has_dropout:
        raise AutoparError("--strategy dropout: the model already runs dropout (its graph has dropout ops); "
                           "leave dropout out of --strategy, it is priced as traced")
    element = _ELEMENT_BYTES[facts.precision]
    hidden_tokens = max((u.input_bytes for u in facts.units if u.layer_type is not None), default=0.0) / element
    units = []
    for unit in facts.units:
        ops: list[OpFacts] = []
        for op in unit.ops:
            if attention == "math" and op.kind == "attention":
                ops += _math_attention(op, facts, element, dropout)
            else:
                ops.append(op)
        if dropout and hidden_tokens:
            sites = 2 if unit.layer_type is not None else 1 if unit.name == "pre" else 0
            ops += [_dropout_op(f"{unit.name}.dropout_{i}", phase, hidden_tokens, element, sharded=False)
                    for i in range(sites) for phase in ("forward", "backward")]
        units.append(dataclasses.replace(unit, ops=tuple(ops)) if len(ops) != len(unit.ops) or ops != list(unit.ops)
                     else unit)
    # the ops added here are not counted at autocast's dtypes (unfused attention's scores are fp32 under
    # it): memory prices the traced bytes times `memory.AUTOCAST_ACTIVATION_FACTOR`, as for uncounted facts
    return dataclasses.replace(facts, units=tuple(units), extra={**facts.extra, "implementation": key},
                               autocast_activation_factor=None)


def _scores_per_sample(facts: ModelFacts) -> float:
    if not facts.heads:
        raise AutoparError("--strategy attention=math needs the model's number of attention heads; "
                           "it is known for zoo models only: leave attention out of --strategy")
    return float(facts.heads) * facts.seq_len ** 2


def _math_attention(op: OpFacts, facts: ModelFacts, element: int, dropout: float) -> list[OpFacts]:
    """A fused attention op (forward or backward) as the unfused kernels it stands for, per sample.

    Forward: QKᵀ and P·V (each half the op's FLOPs, as torch counts them), the softmax, and the
    attention dropout; backward: four GEMMs and the softmax's (and dropout's) backward. The
    fused op's own traffic (q, k, v in, the output out) and saved tensors stay with the first GEMM;
    the softmax output (and the dropout's mask and output) are saved besides."""
    scores = _scores_per_sample(facts)
    heads, seq = float(facts.heads), float(facts.seq_len)
    forward = op.phase == "forward"
    dot_flops = op.flops / 2 if forward else op.flops / 2.5 / 2  # torch counts a flash backward as 2.5 forwards
    head_dim = dot_flops / (2 * scores)
    common = dict(phase=op.phase, kind="matmul", weight_bytes=0.0, tp_sharded=True, reduce_bytes=0.0,
                  saved_sharded=True)
    square = GemmShape((heads, seq, seq, head_dim), scaled=0, split=0)
    thin = GemmShape((heads, seq, head_dim, seq), scaled=0, split=0)
    shapes = [square, thin] if forward else [thin, square, thin, thin]
    gemms = [OpFacts(name=f"{op.name}.gemm{i}", flops=dot_flops, gemm=shape,
                     activation_bytes=(op.activation_bytes if i == 0 else 0.0) + scores * element,
                     saved_bytes=op.saved_bytes if (forward and i == 0) else 0.0, **common)
             for i, shape in enumerate(shapes)]
    vector = dict(phase=op.phase, kind="vector", flops=0.0, weight_bytes=0.0, tp_sharded=True, reduce_bytes=0.0,
                  saved_sharded=True)
    softmax = OpFacts(name=f"{op.name}.softmax", activation_bytes=(2 if forward else 3) * scores * element,
                      saved_bytes=scores * element if forward else 0.0, **vector)
    result = gemms[:1] + [softmax] + gemms[1:]
    if dropout:
        result.insert(2, _dropout_op(f"{op.name}.dropout", op.phase, scores, element, sharded=True, keeps_output=True))
    return result


def _dropout_op(name: str, phase: str, elements: float, element: int, *, sharded: bool,
                keeps_output: bool = False) -> OpFacts:
    """One dropout site per sample: forward reads x and writes y and a mask (kept for backward, with
    y itself when a GEMM reads it next); backward reads the gradient and the mask, writes one."""
    saved = elements * (_MASK_BYTES + (element if keeps_output else 0)) if phase == "forward" else 0.0
    return OpFacts(name=name, phase=phase, kind="vector", flops=0.0,
                   activation_bytes=elements * (2 * element + _MASK_BYTES), weight_bytes=0.0, tp_sharded=sharded,
                   reduce_bytes=0.0, saved_bytes=saved, saved_sharded=sharded)
