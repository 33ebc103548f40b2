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

from hf_families import SEQ, batches, build, example_input, loss_for, vocab_of
from parity_harness import plan_for, run_plans, train_parallel, train_reference

transformers = pytest.importorskip("transformers")

STEPS = 3
GLOBAL_BATCH = 8
TP2 = dict(dp=1, tp=2, pp=1, sp=False, zero=0, microbatch=4, recompute="none")


def hf_tp_plan(family: str, strategy: dict, world: int = 2, use_ilp: bool = False):
    model = build(family)
    heads = 4
    return plan_for(model, (example_input(family),), loss_for(family), name=f"hf-{family}", seq_len=SEQ,
                    heads=heads, kv_heads=heads, vocab=vocab_of(family), strategy=strategy, world=world,
                    global_batch=GLOBAL_BATCH, use_ilp=use_ilp)  # dry runs where the rules refuse


def run_family_job(job: dict) -> dict:
    from autopar.plan_schema import Plan

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


def test_tp2_parity_fused_qkv_masked_lm_encoder_decoder_vision_and_odd_layouts():
    """GPT-2 (a Conv1D fused QKV split after the projection, tied head), BERT (masked LM, tied decoder
    weight and bias), T5 (encoder-decoder, position-bias tables) and a plain-torch encoder with the
    layouts the module rules refused (see `hf_families.OddEncoder`) run tp=2 through DTensor; ViT
    (a convolution first, a CLS token no matmul reads) runs under the module rules, which its dry run
    showed to work. Each trains like one process and sends what its dry run priced."""
    families = ("gpt2", "bert", "t5", "vit", "torch_odd")
    plans = _parity([(family, TP2) for family in families])
    assert [plan.tp_realization for plan in plans] == ["dtensor", "dtensor", "dtensor", "modules", "dtensor"]
    bert, odd = plans[1].param_placements, plans[4].param_placements
    # the tied decoder bias follows its weight (vocabulary-sharded), under the name the graph keeps
    assert bert["bert.embeddings.word_embeddings.weight"] == "RS(0)" and bert["cls.predictions.bias"] == "RS(0)"
    assert odd["start"] == "RR" and odd["qkv_proj.weight"] == "RS(0)" and odd["out_proj.weight"] == "RS(1)"


def test_the_module_rules_refuse_what_dtensor_runs():
    """Without a dry run (no example input), the static module rules still refuse these models' tp."""
    from autopar.runtime.tensor_parallel.realization import capabilities_for

    assert "Conv1D" in capabilities_for(build("gpt2")).tensor_parallel_refusal
    assert "start belongs to a OddEncoder" in capabilities_for(build("torch_odd")).tensor_parallel_refusal
    with_dry_run = capabilities_for(build("torch_odd"), example_input("torch_odd"), loss_for("torch_odd"))
    assert with_dry_run.tensor_parallel_refusal is None and with_dry_run.tp_realization is not None


@pytest.mark.slow
def test_tp2_parity_more_families_recompute_and_searched_placements():
    """GPT-NeoX (fused QKV viewed per head: the module rules run it), BART, a plain-torch model around
    nn.MultiheadAttention (kept replicated, the rest sharded by the module rules), GPT-2 under full and selective recompute
    (the collectives DTensor resends in recomputation priced from the dry run), and GPT-2 with a
    vocabulary tp does not divide (sharded unevenly, as DTensor shards)."""
    cases = [("gpt_neox", TP2), ("bart", TP2), ("torch_mha", TP2),
             ("gpt2", {**TP2, "recompute": "full"}), ("gpt2", {**TP2, "recompute": "selective"}),
             ("gpt2_vocab97", TP2)]
    plans = _parity(cases)
    # nn.MultiheadAttention kept replicated, the module rules run the rest (its 2-D in_proj weight
    # refuses them only while placements are unknown)
    assert [plan.tp_realization for plan in plans] == ["modules", "dtensor", "modules"] + ["dtensor"] * 3
    assert plans[5].param_placements["transformer.wte.weight"] == "RS(0)"  # 97 rows: 49 and 48
    mha = plans[2].param_placements
    assert mha["attn.in_proj_weight"] == "RR" and mha["head.weight"] == "RS(0)"


@pytest.mark.slow
def test_tp2_parity_of_the_intra_op_ilp_placements_through_dtensor():
    """The search with the intra-op ILP on, tp=2 fixed: its proposals are dry-run and priced as they run."""
    (plan,) = _parity([("gpt2", dict(dp=1, tp=2, pp=1, microbatch=4))], use_ilp=True)
    conv1d = [value for name, value in plan.param_placements.items()
              if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))]
    assert plan.op_placements and conv1d
    # the module rules shard no Conv1D weight: a choice that shards one runs through DTensor, one that
    # keeps them replicated under the module rules (since the fifteenth session)
    assert plan.tp_realization == ("dtensor" if any(value != "RR" for value in conv1d) else "modules")


@pytest.mark.slow
def test_data_and_tensor_parallel_through_dtensor_world4():
    """dp=2 × tp=2 on GPT-2 through DTensor, with plain gradient all-reduce and with FSDP2 (ZeRO-3)."""
    plans = _parity([("gpt2", dict(dp=2, tp=2, pp=1, sp=False, zero=zero, microbatch=2, recompute="none"))
                     for zero in (0, 3)], world=4)
    assert [plan.tp_realization for plan in plans] == ["dtensor", "dtensor"]


def test_zero3_ledger_moves_fsdp_padding_and_wraps_the_layer_units():
    """ViT's class token [1, 1, hidden] and position table [1, 17, hidden] split over dp=2 in two
    chunks of one row, one of them padding: FSDP2's all-gathers and reduce-scatters move it, and
    the plan's ledger prices it (it priced the unpadded elements, 4,608 bytes short a step). T5's
    layer units are its q/k/v/o projections: the runtime wraps exactly those as FSDP units, as
    the ledger counts them (it wrapped the 4 feed-forward sub-layers, 5 gathers a step where the
    ledger counted 25)."""
    zero3 = dict(dp=2, tp=1, pp=1, zero=3, microbatch=2)
    _parity([("vit", zero3), ("t5", zero3)])
