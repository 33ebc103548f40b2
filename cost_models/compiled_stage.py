"""What a stage compiled whole with its loss holds (`runtime.compile.compile_forward_loss`), beside eager.

Measured on CPU (`python benchmarks/compiled_memory.py`): the zoo model goes through AOT autograd with
inductor's decompositions and its min-cut partition, as torch.compile runs it, on fake tensors under
bf16 autocast; the forward graph's outputs beyond the loss are what backward keeps. Two and three
layers separate a layer's share from the rest (the embedding, the final norm, the head and the loss).
- **A layer** keeps 1.189 GiB for GPT-1.3B at micro-batch 8 × 2048 (1.001 GiB traced, the cost model's
  activations), and 0.602 GiB for a Llama of hidden 2048, GQA 16/8, at micro-batch 4 × 2048 (0.844
  traced), autocast's 16-bit weight copies apart (they are counted with the weights). The larger ratio
  is taken, applied to the traced bytes (eager's are counted at autocast's dtypes op by op,
  `autocast.autocast_saved_bytes`; its measured 40/32 stands in where they are not).
- **The loss** keeps the logits in their compute precision, not the fp32 log-probabilities that eager
  autograd saves and the trace counts (GPT-1.3B: 1.74 GiB beside the layers against 3.20 traced; the
  Llama: 2.02 against 4.10), and its backward writes the logits' gradient once, in their dtype, from one
  fused kernel (inductor's generated code for `models.lm_loss`, read on CPU) where eager holds two fp32
  gradients of their size (`backward_memory.loss_gradient_bytes`).

Held out: GPT-1.3B compiled at micro-batch 8 allocated 47.5 GiB on the lent H200 (0621687, 7f4beee)
and 47.5 on the H100 (2fef514), against 56.6 eager; the eager model priced it at 65.4 GiB.
In fp32 (no autocast) a layer keeps 1.062 of its traced bytes (GPT) and 0.822 (the Llama); the loss's
terms were measured under bf16 autocast only, so in fp32 the loss keeps eager's. With recompute the
compiled graph keeps checkpointed inputs, which these measurements do not cover: eager's terms there.
"""

from __future__ import annotations

from autopar.capabilities import whole_stage_problem

# min-cut saved bytes per traced activation byte of a layer, the larger of GPT's 1.189/1.001 and
# Llama's 0.602/0.844 (above)
COMPILED_ACTIVATION_FACTOR = 1.19
# the same in fp32, without autocast: GPT 1.062 (GPT-2 124M at 8 x 1024 and GPT-1.3B at 8 x 2048), the
# Llama 0.822
COMPILED_FP32_ACTIVATION_FACTOR = 1.07
# eager autograd per logit: the fp32 log-probabilities log_softmax saves, and the loss backward's two
# fp32 gradients (of nll_loss and of log_softmax)
EAGER_SAVED_BYTES_PER_LOGIT = 4
EAGER_LOSS_GRADIENT_BYTES_PER_LOGIT = 8
# the same backward on vocabulary shards under `loss_parallel` (tp's vocabulary-parallel head): DTensor's
# log_softmax backward is decomposed, the exponentiated log-probabilities a tensor of their own beside the
# two gradients, three fp32 shards at its peak. Measured with the CPU allocator's events (torch 2.13,
# gloo, tp = 2): the cross entropy alone held 4 shard-sized tensors at its peak against 3 for the plain
# one, and GPT and Llama steps held one fp32 shard of the logits more than 8 bytes per logit priced
VOCAB_PARALLEL_LOSS_GRADIENT_BYTES_PER_LOGIT = 12


def whole_stage_compiled(strategy) -> bool:
    """Whether the runtime compiles this plan's stage as one graph with its loss."""
    return bool(strategy.compile) and whole_stage_problem(strategy) is None


def compiled_layers(strategy) -> bool:
    """Whether the activations are min-cut's (`COMPILED_ACTIVATION_FACTOR`, the loss's too under bf16
    autocast): a whole compiled stage without recompute, what was measured."""
    return whole_stage_compiled(strategy) and strategy.recompute == "none"


def logit_element_bytes(precision: str) -> int:
    """Bytes of one logit in the compute precision (what the compiled loss keeps and writes)."""
    return 4 if precision == "fp32" else 2


def loss_bytes_per_logit(precision: str, compiled: bool, loss_parallel: bool = False) -> tuple[int, int]:
    """(saved for backward, the backward's transient gradients) per logit: eager's fp32 log-probabilities
    and two fp32 gradients (three under `loss_parallel`), or the compiled loss's logits and one gradient in
    their own precision."""
    if loss_parallel:  # never compiled whole: tp > 1
        return EAGER_SAVED_BYTES_PER_LOGIT, VOCAB_PARALLEL_LOSS_GRADIENT_BYTES_PER_LOGIT
    if not compiled:
        return EAGER_SAVED_BYTES_PER_LOGIT, EAGER_LOSS_GRADIENT_BYTES_PER_LOGIT
    element = logit_element_bytes(precision)
    return element, element
