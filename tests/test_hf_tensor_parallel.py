"""Tensor parallelism on Hugging Face models of several families, through the public path: trace →
search (tp decided and priced by dry runs of the placements) → build_plan → autopar.parallelize.

Each plan trains like the model on one process (losses to rel 1e-5, gathered final weights to
1e-5) with every parameter placed as planned, and every rank sends in a step exactly the
collectives the plan predicted from its dry run.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_families import SEQ, VOCAB, batches, build, example_input, loss_for
from parity_harness import plan_for, run_plans, train_parallel, train_reference

transformers = pytest.importorskip("transformers")

STEPS = 3
GLOBAL_BATCH = 8
TP2 = dict(dp=1, tp=2, pp=1, sp=False, zero=0, microbatch=4, recompute="none")


def hf_tp_plan(family: str, strategy: dict, world: int = 2, use_ilp: bool = False):
    model = build(family)
    heads = 4
    return plan_for(model, (example_input(family),), loss_for(family), name=f"hf-{family}", seq_len=SEQ,
                    heads=heads, kv_heads=heads, vocab=VOCAB, strategy=strategy, world=world,
                    global_batch=GLOBAL_BATCH, use_ilp=use_ilp, dry_run=True)


def run_family_job(job: dict) -> dict:
    from autopar.plan import Plan

    family = job["family"]
    return train_parallel(build(family), loss_for(family), Plan.from_json(job["plan"]), job["data"])


def _parity(cases: list[tuple[str, dict]], world: int = 2, use_ilp: bool = False) -> list:
    from test_runtime_parity import _check

    plans = [hf_tp_plan(family, strategy, world, use_ilp=use_ilp) for family, strategy in cases]
    data = {family: batches(family, GLOBAL_BATCH, STEPS) for family, _ in cases}
    jobs = [dict(plan=plan.to_json(), family=family, data=data[family]) for plan, (family, _) in zip(plans, cases)]
    results = run_plans(world, jobs, runner=run_family_job)
    for plan, ranks, (family, strategy) in zip(plans, results, cases):
        losses, state = train_reference(copy.deepcopy(build(family)), loss_for(family), data[family])
        _check({"family": family, **strategy}, plan, ranks, losses, state)
    return plans


def test_tp2_parity_fused_qkv_masked_lm_encoder_decoder_vision():
    """GPT-2 (a Conv1D fused QKV split after the projection, tied head), BERT (masked LM, tied decoder
    weight and bias), T5 (encoder-decoder, position-bias tables) run tp=2 through DTensor (the module
    rules refuse or break on them); ViT (a convolution first, a CLS token no matmul reads) runs under
    the module rules, which its dry run showed to work. Each trains like one process and sends
    what its dry run priced."""
    plans = _parity([(family, TP2) for family in ("gpt2", "bert", "t5", "vit")])
    assert [plan.tp_realization for plan in plans] == ["dtensor", "dtensor", "dtensor", "modules"]


@pytest.mark.slow
def test_tp2_parity_more_families_recompute_and_searched_placements():
    """GPT-NeoX (fused QKV viewed per head: the module rules run it), BART, a plain-torch model around
    nn.MultiheadAttention (kept replicated, the rest sharded), GPT-2 under full and selective recompute
    (the collectives DTensor resends in recomputation priced from the dry run)."""
    cases = [("gpt_neox", TP2), ("bart", TP2), ("torch_mha", TP2),
             ("gpt2", {**TP2, "recompute": "full"}), ("gpt2", {**TP2, "recompute": "selective"})]
    plans = _parity(cases)
    assert [plan.tp_realization for plan in plans] == ["modules", "dtensor", "dtensor", "dtensor", "dtensor"]
    mha = plans[2].param_placements
    assert mha["attn.in_proj_weight"] == "RR" and mha["head.weight"] == "RS(0)"


@pytest.mark.slow
def test_tp2_parity_of_the_intra_op_ilp_placements_through_dtensor():
    """The search with the intra-op ILP on, tp=2 fixed: its proposals are dry-run and priced as they run."""
    plans = _parity([("gpt2", dict(dp=1, tp=2, pp=1, microbatch=4))], use_ilp=True)
    assert plans[0].op_placements and plans[0].tp_realization == "dtensor"
