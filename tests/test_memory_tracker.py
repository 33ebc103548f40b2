"""The analytic memory model against torch's own tracker (issue #29): `profiler.memory_tracker` runs
two training steps of the runtime's single-GPU loop on fake CPU tensors under MemTracker, and
`cost_models` prices the same plan; the prediction less its fragmentation margin (tensor storage,
what the tracker counts: `memory.storage_bytes`) is compared with the tracked peak.

Measured on the shapes below (benchmarks/memory_tracker_shapes.py gives a wider table): ratios
0.998-1.001 in fp32 (GPT and Llama, no, full and selective recompute, micro-batches 1x1, 2x1, 1x2);
in bf16, with the activations counted at autocast's dtypes op by op (`autocast.autocast_saved_bytes`),
1.003-1.004 for the GPT without recompute, 1.026 for Llama, 1.025-1.041 with selective or full
recompute, and 1.057 for Llama with full recompute. Selective recompute keeps every output of the
products, which the runtime's policy caches (a 16-layer Llama at sequence 4,096: 1.025, where counting
only what backward reads gave 0.83). Asserted: within 5% and never more than 2% below, Llama's full
recompute within 6%.
"""

from __future__ import annotations

import pytest

import autopar
from autopar.cost_models.memory import activation_factor, storage_bytes
from autopar.models import build_model
from autopar.profiler.memory_tracker import tracked_step_memory

GPT = "layers=2,hidden=256,heads=4,vocab=8000,seq_len=512"
LLAMA = "layers=2,hidden=256,heads=4,kv_heads=2,vocab=8000,seq_len=512"
# (model, config, seq, microbatch, micro-batches, precision, recompute, optimizer, bound on |ratio - 1|)
SHAPES = [
    ("gpt", GPT, 256, 1, 1, "fp32", "none", "fused", 0.05),
    ("gpt", GPT, 256, 2, 1, "fp32", "full", "fused", 0.05),
    ("gpt", GPT, 256, 1, 2, "fp32", "selective", "fused", 0.05),
    ("llama", LLAMA, 256, 1, 1, "fp32", "none", "fused", 0.05),
    ("llama", LLAMA, 256, 2, 1, "fp32", "full", "fused", 0.05),
    ("gpt", GPT, 256, 1, 1, "bf16", "none", "fused", 0.05),
    ("gpt", GPT, 256, 1, 1, "bf16", "none", "foreach", 0.05),
    ("gpt", GPT, 256, 2, 1, "bf16", "none", "fused", 0.05),
    ("gpt", GPT, 256, 2, 2, "bf16", "none", "fused", 0.05),
    ("gpt", GPT, 512, 1, 1, "bf16", "none", "fused", 0.05),
    ("gpt", GPT, 256, 2, 1, "bf16", "full", "fused", 0.05),
    ("gpt", GPT, 256, 2, 1, "bf16", "selective", "fused", 0.05),
    ("llama", LLAMA, 256, 2, 1, "bf16", "none", "fused", 0.05),
    ("llama", LLAMA, 256, 2, 1, "bf16", "full", "fused", 0.06),
    ("llama", "layers=16,hidden=1024,heads=16,kv_heads=8,vocab=8000,seq_len=4096", 4096, 4, 1, "bf16", "selective",
     "fused", 0.05),
    ("llama", "layers=4,hidden=512,heads=8,kv_heads=4,vocab=8000,seq_len=2048", 2048, 2, 1, "fp32", "selective",
     "fused", 0.05),
]
CLUSTER = autopar.load_cluster("dgx-h100", gpus=1)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-s{s[2]}-{s[3]}x{s[4]}-{s[5]}-{s[6]}-{s[7]}")
def test_the_analytic_peak_is_the_tracked_one_within_its_bound_and_never_below(shape):
    model, config, seq, microbatch, count, precision, recompute, optimizer, bound = shape
    tracked = tracked_step_memory(model, config, seq, microbatch, count, precision, recompute, optimizer)
    assert tracked["dtype_check"] == precision  # autocast really cast (a bf16 linear output under bf16)
    spec = build_model(model, config)
    strategy = f"dp=1,tp=1,pp=1,zero=0,recompute={recompute},microbatch={microbatch},optimizer_impl={optimizer}"
    result = autopar.plan(spec.module, spec.example_inputs(1, seq), cluster=CLUSTER,
                          global_batch=microbatch * count, loss_fn=spec.loss_fn, precision=precision, seq_len=seq,
                          strategy=strategy + (",recompute_layers=all" if recompute != "none" else ""))
    factor = activation_factor(precision, 0, "none", "fp32", autocast_counted=result.prediction.autocast_activations)
    predicted = storage_bytes(result.prediction.memory[0], factor)
    ratio = predicted / tracked["peak_bytes"]
    assert 1 - 0.02 <= ratio <= 1 + bound, (ratio, tracked["by_category"], result.prediction.memory[0])
