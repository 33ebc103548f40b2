"""Pipeline stages wherever the repeated blocks sit: Hugging Face models through the public path
(trace → search under the runtime's capabilities → build_plan → autopar.parallelize).

Parity as in test_runtime_parity: every loss matches one process to relative 1e-5, the gathered
final weights to 1e-5, and each rank's collectives in a step (pp send/recv of every tensor that
crosses a cut included) are those the plan predicted.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hf_tiny
from parity_harness import plan_for, run_plans, train_parallel, train_reference

pytest.importorskip("transformers")

STEPS = 4
GLOBAL_BATCH = 8


def hf_plan(family: str, strategy: dict, world: int):
    model = hf_tiny.build(family)
    heads, kv_heads = hf_tiny.heads(family)
    return plan_for(model, hf_tiny.example_inputs(family, 1), hf_tiny.loss_fn, name=f"tiny-{family}",
                    seq_len=hf_tiny.SEQ, heads=heads, kv_heads=kv_heads, vocab=hf_tiny.VOCAB, strategy=strategy,
                    world=world, global_batch=GLOBAL_BATCH)


def run_job(job: dict) -> dict:
    from autopar.plan import Plan

    return train_parallel(hf_tiny.build(job["family"]), hf_tiny.loss_fn, Plan.from_json(job["plan"]), job["data"])


def _parity(cases: list[tuple[str, dict]], world: int) -> None:
    from test_runtime_parity import _check

    plans = [hf_plan(family, strategy, world) for family, strategy in cases]
    data = {family: hf_tiny.data(family, GLOBAL_BATCH, STEPS) for family, _ in cases}
    jobs = [dict(plan=plan.to_json(), family=family, data=data[family]) for (family, _), plan in zip(cases, plans)]
    results = run_plans(world, jobs, runner=run_job)
    references = {family: train_reference(copy.deepcopy(hf_tiny.build(family)), hf_tiny.loss_fn, data[family])
                  for family in data}
    for (family, strategy), plan, ranks in zip(cases, plans, results):
        _check({"model": family, **strategy}, plan, ranks, *references[family])


CAUSAL_WORLD2 = [
    ("llama", dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2)),
    ("llama", dict(dp=1, tp=1, pp=2, schedule="interleaved", vp=2, microbatch=2)),
    ("gpt2", dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2)),
    ("gpt2", dict(dp=1, tp=1, pp=2, schedule="interleaved", vp=2, microbatch=1)),
]


def test_causal_lms_1f1b_and_interleaved():
    """`model.layers.N` inside LlamaModel, `transformer.h.N` inside GPT2Model (its embedding tied
    to the head on the other pipeline rank: their gradients summed)."""
    _parity(CAUSAL_WORLD2, world=2)


OTHER_WORLD2 = [
    ("t5", dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2)),
    ("bart", dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2)),
    ("vit", dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2)),
]


def test_encoder_decoders_and_a_vision_transformer():
    """T5 and BART: the encoder's output crosses to the decoder's stages (T5 also hands its relative
    position bias down each stack); ViT: patch embeddings, then the layers of `vit.encoder`."""
    _parity(OTHER_WORLD2, world=2)


WORLD4 = [
    ("llama", dict(dp=2, tp=1, pp=2, schedule="1f1b", zero=0, microbatch=1)),
    ("gpt2", dict(dp=2, tp=1, pp=2, schedule="gpipe", zero=1, microbatch=1)),
]


def test_pipeline_and_data_parallel_world4():
    _parity(WORLD4, world=4)
