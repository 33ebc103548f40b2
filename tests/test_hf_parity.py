"""Parity on Hugging Face transformers models through the public path: trace → search (under the
runtime's capabilities for this model) → build_plan → autopar.parallelize.

A user hands autopar a constructed model: its own initialized weights are the init source, so every
plan must train exactly like that model on one process (losses to rel 1e-5, gathered final weights
to 1e-5), with the collectives the plan predicted. What the runtime cannot run for a model is
refused by the searcher, never offered.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from parity_harness import SEED, batches, plan_for, run_plans, train_parallel, train_reference

transformers = pytest.importorskip("transformers")

STEPS = 5
GLOBAL_BATCH = 8
SEQ = 16
VOCAB = 96


def hf_model(family: str) -> torch.nn.Module:
    """A tiny HF causal LM (eager attention, no dropout), initialized by HF itself under SEED."""
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, use_cache=False, attn_implementation="eager")
    if family == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          attention_dropout=0.0, pad_token_id=None, **common)
        cls = transformers.LlamaForCausalLM
    elif family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, **common)
        cls = transformers.GPT2LMHeadModel
    else:
        raise ValueError(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return cls(config)


def hf_loss(output, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy on the HF output's logits (works on vocab-sharded DTensor logits)."""
    logits = output.logits
    vocab = logits.shape[-1]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(),
                                             input_ids[:, 1:].reshape(-1))


def hf_plan(family: str, strategy: dict, world: int, use_ilp: bool = False):
    model = hf_model(family)
    config = model.config
    example = (torch.zeros(1, SEQ, dtype=torch.long, device="meta"),)
    return plan_for(model, example, hf_loss, name=f"hf-{family}", seq_len=SEQ, heads=config.num_attention_heads,
                    kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
                    vocab=config.vocab_size, strategy=strategy, world=world, global_batch=GLOBAL_BATCH,
                    use_ilp=use_ilp)


def run_hf_job(job: dict) -> dict:
    """In each process: the user's model, constructed as on one process, parallelized by the plan."""
    from autopar.plan_schema import Plan

    return train_parallel(hf_model(job["family"]), hf_loss, Plan.from_json(job["plan"]), job["data"],
                          compile=job.get("compile"))


def _parity(family: str, strategies: list[dict], world: int, extra_plans: list = (),
            compile: bool | None = None) -> list[list[dict]]:
    """Every strategy's plan (plus `extra_plans`, each with its strategy) trains like one process."""
    from test_runtime_parity import _check

    data = batches(VOCAB, GLOBAL_BATCH, SEQ, STEPS)
    cases = [(strategy, hf_plan(family, strategy, world)) for strategy in strategies] + list(extra_plans)
    jobs = [dict(plan=plan.to_json(), family=family, data=data, compile=compile) for _, plan in cases]
    results = run_plans(world, jobs, runner=run_hf_job)
    losses, state = train_reference(copy.deepcopy(hf_model(family)), hf_loss, data)
    for (strategy, plan), ranks in zip(cases, results):
        _check(strategy, plan, ranks, losses, state)
    return results


def _searched(family: str, world: int, fixed: dict | None = None):
    """The plan a user gets by default: the searcher's choice with the intra-op ILP on, as a case."""
    plan = hf_plan(family, fixed or {}, world, use_ilp=True)
    strategy = {key: getattr(plan.strategy, key) for key in ("dp", "tp", "pp", "zero", "sp", "microbatch")}
    return strategy, plan


LLAMA_WORLD2 = [
    dict(dp=2, tp=1, pp=1, zero=0, microbatch=2),
    dict(dp=2, tp=1, pp=1, zero=3, microbatch=2),
    dict(dp=1, tp=2, pp=1, zero=0, microbatch=4),
    dict(dp=1, tp=2, pp=1, sp=True, zero=0, microbatch=4),
    dict(dp=2, tp=1, pp=1, zero=2, microbatch=2, recompute="full"),
    dict(dp=1, tp=2, pp=1, zero=0, microbatch=4, recompute="selective"),
    dict(dp=2, tp=1, pp=1, zero=0, microbatch=2, recompute="full", recompute_layers=(1,)),
    dict(dp=2, tp=1, pp=1, zero=3, microbatch=2, offload="optimizer"),
]


def test_hf_llama_world2_plan_kinds():
    """dp, ZeRO (FSDP2), tp and tp+sp, recompute (one layer of two, too), optimizer offload, the ILP's
    tp placements, and the default search's choice."""
    _parity("llama", LLAMA_WORLD2, world=2,
            extra_plans=[_searched("llama", 2, dict(tp=2, microbatch=4)), _searched("llama", 2)])


GPT2_WORLD2 = [
    dict(dp=2, tp=1, pp=1, zero=0, microbatch=2),
    dict(dp=2, tp=1, pp=1, zero=3, microbatch=2),
    dict(dp=2, tp=1, pp=1, zero=1, microbatch=2, recompute="full"),
]


def test_hf_gpt2_world2_plan_kinds():
    """GPT-2 (Conv1D projections, tied head) under dp, ZeRO and recompute, and the default search's choice."""
    _parity("gpt2", GPT2_WORLD2, world=2, extra_plans=[_searched("gpt2", 2)])


@pytest.mark.parametrize("family", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_hf_models_compiled_train_like_one_process_with_their_ledgers(family):
    """`compile=True` on a model as Hugging Face builds it: the whole stage with its loss under dp at
    ZeRO 0, each block under ZeRO 3 with recompute (FSDP2's hooks outside the graphs) and, for Llama,
    under the module rules' tp, with full recompute too (the block compiled inside its checkpoint).
    The compiled code's collectives are the plan's, full recompute's resent ones included."""
    strategies = [dict(dp=2, tp=1, pp=1, zero=0, microbatch=2),
                  dict(dp=2, tp=1, pp=1, zero=3, microbatch=2, recompute="full")]
    if family == "llama":
        strategies += [dict(dp=1, tp=2, pp=1, zero=0, microbatch=4),
                       dict(dp=1, tp=2, pp=1, zero=0, microbatch=4, recompute="full")]
    results = _parity(family, strategies, world=2, compile=True)
    ways = [ranks[0]["compile"] for ranks in results]
    assert ways[0] == "whole stage with its loss", ways
    assert all(way.startswith("per block") for way in ways[1:]), ways


LLAMA_WORLD4 = [
    dict(dp=2, tp=2, pp=1, zero=1, microbatch=2),
    dict(dp=2, tp=2, pp=1, sp=True, zero=3, microbatch=2),
]


@pytest.mark.slow
def test_hf_llama_world4_data_and_tensor_parallel():
    _parity("llama", LLAMA_WORLD4, world=4)


@pytest.mark.parametrize("family, strategy, world, reason", [
    ("gpt2", dict(tp=2, sp=True), 2, "sequence parallelism runs only under the module rules"),
    ("gpt2", dict(tp=2, pp=2), 4, "only through DTensor, which the runtime does not combine with pipeline stages"),
])
def test_searcher_refuses_what_the_runtime_cannot_run(family, strategy, world, reason):
    """GPT-2's Conv1D projections run tp only through DTensor (tests/test_hf_tensor_parallel.py), which
    has neither sequence parallelism nor pipeline stages. Asked for either, the searcher names the
    reason; left free, it rejects every such candidate for it."""
    from autopar.cluster import load_cluster
    from autopar.errors import AutoparError
    import autopar

    with pytest.raises(AutoparError, match=reason):
        hf_plan(family, strategy, world)
    model = hf_model(family)
    example = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    result = autopar.plan(model, (example,), cluster=load_cluster("dgx-h100", gpus=4), global_batch=GLOBAL_BATCH,
                          loss_fn=hf_loss, precision="fp32", name=family, seq_len=SEQ, use_ilp=False).search
    assert sum(count for why, count in result.rejected.items() if re.search(reason, why)) > 0, result.rejected
    refused = [c.strategy for c in result.ranked if all(getattr(c.strategy, k) == v for k, v in strategy.items())]
    assert not refused, refused


def test_dtensor_tensor_parallelism_is_not_compiled():
    """GPT-2's tp runs through DTensor, whose compiled blocks failed mid-backward (an unused DTensor
    output of a block compiled in pieces): with compile the searcher offers it no tp > 1 and says
    why, and `parallelize(compile=True)` refuses an eager DTensor plan before anything runs."""
    from autopar.errors import AutoparError
    from autopar.runtime.parallelize import parallelize
    import autopar

    reason = "runs on this model only through DTensor, which the runtime does not compile"
    with pytest.raises(AutoparError, match=reason):
        hf_plan("gpt2", dict(tp=2, compile=True), 2)
    model = hf_model("gpt2")
    example = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    result = autopar.plan(model, (example,), cluster=autopar.load_cluster("dgx-h100", gpus=2),
                          global_batch=GLOBAL_BATCH, loss_fn=hf_loss, precision="fp32", name="gpt2", seq_len=SEQ,
                          strategy=dict(compile=True), use_ilp=False).search
    assert sum(count for why, count in result.rejected.items() if reason in why) > 0, result.rejected
    assert result.ranked and all(c.strategy.tp == 1 for c in result.ranked)
    eager = hf_plan("gpt2", dict(tp=2), 2)
    assert eager.tp_realization == "dtensor"
    with pytest.raises(AutoparError, match="runs through DTensor, which the runtime does not compile"):
        parallelize(hf_model("gpt2"), eager, loss_fn=hf_loss, compile=True)


def test_a_meta_device_hf_model_needs_real_weights():
    """HF modules without reset_parameters (RMSNorm) cannot be initialized from meta: the message says
    to pass the constructed model, whose weights then are the source (what the parity tests do)."""
    from autopar.errors import AutoparError
    from autopar.runtime.init import InitSource

    with torch.device("meta"):
        model = hf_model("llama")
    with pytest.raises(AutoparError, match="pass a model with real weights"):
        InitSource(model, SEED).full_value("model.norm.weight")
    real = hf_model("llama")
    torch.testing.assert_close(InitSource(real, SEED).full_value("model.norm.weight"), real.model.norm.weight.detach(),
                               rtol=0, atol=0)
