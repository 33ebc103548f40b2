"""What a stage's backward holds beside its kept activations, at its largest: the loss's gradients at
the head (and a padded layer's copied output gradient), a unit's gradients in flight beside what
recompute rebuilds for it, a weight's fresh gradient where micro-batches accumulate and, under tp, a
vocabulary-parallel lookup's whole-table gradient. `evaluate.rank_memory` adds the larger of the head's
and a unit's to each pipeline rank's peak.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from autopar.capabilities import gemm_padding_problem
from autopar.plan_schema import ZERO_BUBBLE_SCHEDULES, Strategy
from autopar.cost_models.compiled_stage import EAGER_SAVED_BYTES_PER_LOGIT, compiled_layers, loss_bytes_per_logit
from autopar.cost_models.context import rank_batch
from autopar.cost_models.facts import ModelFacts, Unit
from autopar.cost_models.memory import LossLayout, autocast_states
from autopar.cost_models.recompute import stage_policies
from autopar.cost_models.stage_costs import CostCache, Pricing, autocast_activations, unit_kept_bytes


def backward_working_bytes(pricing: Pricing, units: list[Unit], stage_index: int) -> float:
    """`stage_backward_bytes` of stage `stage_index` under the plan's recompute policies."""
    s, facts = pricing.strategy, pricing.facts
    return stage_backward_bytes(s, units, stage_policies(units, s, stage_index), pricing.next_units.get,
                                loss_unit(facts),
                                autocast_activations(pricing), pricing.block_casts_once, pricing.cache)


def loss_unit(facts: ModelFacts) -> str | None:
    """The unit whose backward starts from the loss's gradients: a language model's last (its head)."""
    return facts.units[-1].name if facts.vocab and facts.units else None


def stage_backward_bytes(s: Strategy, units: Sequence[Unit], policies: Sequence[str],
                         next_unit: Callable[[str], Unit | None], loss_unit: str | None, autocast: bool,
                         casts_once: bool, cache: CostCache | None = None) -> float:
    """What one stage's backward holds beyond the micro-batches kept at the rank's peak, the most at any
    of its units: the unit's working set (`unit_working_bytes`) and what recompute rebuilds for it (its
    activations under `policy`, `stage_costs.unit_kept_bytes`), both held while it is differentiated,
    less what the units after it on the stage have already freed of that micro-batch (nothing under a
    split backward, which holds them until the W pass). A first stage's embedding makes its table-sized
    fresh gradient late, a middle layer its working gradients early. `loss_unit` (the model's last, when
    it ends in a vocabulary's loss) keeps only its fresh gradient: the loss's are `head_gradient_bytes`'.

    Measured on CPU/gloo (`benchmarks/rank_memory_cases.py`): a first stage of a 1,024-word vocabulary
    peaked at its MLP's backward with the 4h gradient and the down projection's fresh gradient beside
    both micro-batches' activations (4.5% over this before it was counted); with an 8,000-word table,
    at the embedding's backward with one micro-batch's activations freed (a table's gradient counted
    on top of them was 6% over; GPipe's 23%). Under full recompute of a 1,024-position stage, the
    rebuilt layer's activations and its working set were both live: the larger of them alone was 8.5%
    under."""
    releases = s.schedule not in ZERO_BUBBLE_SCHEDULES
    held = freed = 0.0
    for unit, policy in zip(reversed(units), reversed(policies)):
        kept, rebuilt = unit_kept_bytes(unit, s, policy, cache, autocast, casts_once)
        here = unit_working_bytes(s, unit, next_unit(unit.name), autocast, cache, holds_loss=unit.name == loss_unit)
        held = max(held, here + rebuilt - freed)
        freed += kept if releases else 0.0
    return held


def unit_working_bytes(s: Strategy, unit: Unit, following: Unit | None, autocast: bool,
                       cache: CostCache | None = None, holds_loss: bool = False) -> float:
    """What differentiating one unit holds at once for one micro-batch on one rank: the gradient of the
    stream it sends on (`following`'s input; the unit's own where none follows), the gradient of its
    largest saved tensor (an MLP's 4h-wide input to its down projection) and, accumulating without
    ZeRO, its largest weight's fresh gradient (`accumulated_gradient_bytes`) or, under tp, a lookup's
    whole-table gradients (`lookup_gradient_bytes`), the larger. A unit holding the loss
    (`holds_loss`) keeps only the last: its gradients in flight are the loss's (`head_gradient_bytes`)."""
    def own() -> tuple[float, float]:
        largest = max(((op.autocast_saved_bytes if autocast and op.autocast_saved_bytes is not None
                        else op.saved_bytes) / (s.tp if op.saved_sharded else 1) for op in unit.forward_ops),
                      default=0.0)
        # the lookup's whole tables come before the rows' fresh gradient they reduce to: the larger
        return largest, max(accumulated_gradient_bytes(s, [unit]), lookup_gradient_bytes(s, unit))

    key = ("working", s.tp, autocast, s.zero >= 1 or s.num_microbatches == 1, s.ep, s.pp > 1)
    largest, fresh = own() if cache is None else cache.get(unit, key, own)
    if holds_loss:
        return fresh
    after = following or unit
    stream = after.autocast_input_bytes if autocast and after.autocast_input_bytes is not None else after.input_bytes
    return rank_batch(s) * (stream / (s.tp if s.sp else 1) + largest) + fresh


def lookup_gradient_bytes(s: Strategy, unit: Unit) -> float:
    """A vocabulary-parallel embedding's backward under tp: the runtime shards its table by rows
    (`RowwiseParallel`, a DTensor), and DTensor has no row-sharded strategy for the lookup's backward
    (torch's `embedding_dense_backward_strategy` offers column shards, partial sums or replicas), so it
    makes the whole table's gradient, partial over tp, before it reduces that to the rank's rows. Measured
    on CPU/gloo (`benchmarks/rank_memory_cases.py`, pp = 2 × tp = 2): the first stage peaked in the
    lookup's backward with two whole fp32 tables' gradients alive, 0.79 of the model before they were
    counted. Counted: two fp32 tables, the largest trainable such table of the unit (over where the
    parameters are 16-bit, and for a table the ILP shards by columns: `param_tp_dims` marks looked-up
    tables row-sharded)."""
    if s.tp == 1 or not unit.param_looked_up:
        return 0.0
    trainable = unit.param_trainable or (True,) * len(unit.param_shapes)
    tables = [math.prod(shape) for (shape, split), looked_up, trains
              in zip(unit.param_shapes, unit.param_looked_up, trainable) if looked_up and trains and split == 0]
    return 2 * 4.0 * max(tables, default=0)


def accumulated_gradient_bytes(s: Strategy, units: list[Unit]) -> float:
    """Accumulating micro-batches' gradients without ZeRO, autograd makes each weight's fresh gradient
    beside the one it adds into: the largest trainable weight's fp32 gradient on this rank (its tp shard;
    a stacked experts tensor's 1/ep; a tied weight's copy borrowed from another stage), such as an
    embedding table's dense gradient. Measured on CPU/gloo (`benchmarks/rank_memory_cases.py`): a first
    pipeline stage peaked at its embedding's backward with two table-sized gradients alive. Counted on
    top of the rank's in-flight peak, though a first stage's embedding backward ends its micro-batch:
    over, on the safe side. FSDP2 (ZeRO >= 1) accumulates its own way: left out."""
    if s.zero >= 1 or s.num_microbatches == 1:
        return 0.0
    largest = 0.0
    for unit in units:
        trainable = unit.param_trainable or (True,) * len(unit.param_shapes)
        for (shape, split), trains in zip(unit.param_shapes, trainable):
            if trains:  # the zoo's experts are its only 3-D weights, stacked over the experts
                experts = s.ep if len(shape) == 3 else 1
                largest = max(largest, math.prod(shape) / (s.tp if split is not None else 1) / experts)
        if s.pp > 1:  # a tied weight's copy on this stage (`evaluate` adds it to the rank's states)
            for _, elements, sharded in unit.borrowed:
                largest = max(largest, elements / (s.tp if sharded else 1))
    return 4.0 * largest


def loss_gradient_bytes(facts, s: Strategy, loss: LossLayout | None = None) -> float:
    """The cross entropy's backward at the head: the gradients of its nll_loss and of its log_softmax,
    two fp32 tensors the size of the logits beside the saved log-probabilities (counted with the
    activations), at the peak of the last stage (MemTracker, `profiler/memory_tracker.py`: 8·b·s·V
    bytes exactly); three, on vocabulary shards (divided by tp), when the loss runs under `loss_parallel`
    (`LossLayout`). A stage compiled whole writes one gradient in the logits' dtype (`cost_models.compiled_stage`)."""
    if not facts.vocab:
        return 0.0
    loss = loss or LossLayout()
    _, gradient = loss_bytes_per_logit(facts.precision, _compiled_loss(facts, s), loss.loss_parallel)
    return gradient * _logits(facts, s, loss)


def _compiled_loss(facts, s: Strategy) -> bool:
    """Whether the loss is priced as compiled: a whole stage without recompute, under bf16 autocast
    (what `cost_models.compiled_stage` measured)."""
    return compiled_layers(s) and autocast_states(facts.precision, s.zero, s.offload, s.optimizer_state)


def _logits(facts, s: Strategy, loss: LossLayout | None = None) -> float:
    """Logits of one micro-batch on the last stage: on vocabulary shards where the loss runs on them."""
    shards = s.tp if loss is not None and loss.vocab_parallel else 1
    return s.microbatch * facts.seq_len / s.cp * facts.vocab / shards


def compiled_loss_saving_bytes(facts, s: Strategy) -> float:
    """What a stage compiled whole saves less for its loss than the trace counts (fp32 log-probabilities
    against the logits in their precision, `cost_models.compiled_stage`); 0 elsewhere."""
    if not facts.vocab or not _compiled_loss(facts, s):
        return 0.0
    saved, _ = loss_bytes_per_logit(facts.precision, compiled=True)
    return (EAGER_SAVED_BYTES_PER_LOGIT - saved) * _logits(facts, s)


def head_gradient_bytes(facts: ModelFacts, s: Strategy, loss: LossLayout | None = None) -> float:
    """What the head's backward holds beside the activations, at its largest: the loss's gradients
    (`loss_gradient_bytes`) or, where the runtime pads a misaligned layer, the padded copy of its output
    gradient (`padding_transient_bytes`) beside the 16-bit gradient it copies; eager, the cast to 16 bits
    comes after the loss's fp32 gradients are freed, and a stage compiled whole writes the padded
    gradient in place of the other. So the two do not add: on one H200 (0621687, 51e73c2), GPT-1.3B with
    its 50,257-wide head padded at runtime allocated what the model built 50,304 wide did, eager
    (56.6 GiB both) and compiled whole (47.5 GiB both), where their sum priced it 1.5 GiB more. Measured
    without ZeRO only; the copied gradient is taken as the logits' (the widest padded layer is the head
    in the zoo and Hugging Face's models)."""
    gradients = loss_gradient_bytes(facts, s, loss)
    padding = padding_transient_bytes(facts, s)
    if not padding:
        return gradients
    source = 0.0 if _compiled_loss(facts, s) or not facts.vocab else 2.0 * _logits(facts, s, loss)
    return max(gradients, source + padding)


def padding_transient_bytes(facts: ModelFacts, s: Strategy) -> float:
    """The output gradient a padded linear layer's backward copies to its padded width (16-bit,
    `compute.padding_copy_bytes`), beside the loss's gradients at the head: the widest such copy,
    where the runtime pads (`capabilities.gemm_padding_problem`)."""
    if gemm_padding_problem(s, facts.precision) is not None:
        return 0.0
    return max((2.0 * op.gemm.padding[1] * op.gemm.at(rank_batch(s), 1)[op.gemm.scaled]
                for unit in facts.units if unit.padded_gemms for op in unit.backward_ops
                if op.gemm is not None and op.gemm.padding is not None and not op.weight_gradient), default=0.0)
