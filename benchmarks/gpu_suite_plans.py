"""The suite's rows (issue #29: micro-batch, recompute, precision, compile, offload, a Llama and a 2.7B
model), planned on CPU with `autopar.plan` for one GPU of a preset, so that the device's minutes go
to measuring (`gpu_suite.py --predict-only`)."""

from __future__ import annotations

import time

GPT13 = ("gpt3-1.3b", None, 2048)
# (case, model, model_config, seq_len, global_batch, precision, fixed strategy or None for the search's, compile:
# True, False, or CHOOSE: searched both ways, the plan predicted faster kept, as `autopar run` does on a GPU)
CHOOSE = "choose"
PLANS = [
    # run first, before any `parallelize` turns expandable segments on (runtime/allocator.py): the same
    # plan as g13-mb8-full under the allocator's default, so reserved memory compares both settings
    ("g13-mb8-full-default-allocator", *GPT13, 8, "bf16",
     "dp=1,tp=1,pp=1,zero=0,recompute=full,microbatch=8", False),
    ("g13-mb8-none", *GPT13, 8, "bf16", "dp=1,tp=1,pp=1,zero=0,recompute=none,microbatch=8", False),
    ("g13-mb8-sel", *GPT13, 8, "bf16", "dp=1,tp=1,pp=1,zero=0,recompute=selective,microbatch=8", False),
    # fp16 under the runtime's dynamic loss scale (twelfth session): priced as bf16 is; not yet measured
    ("g13-mb8-none-fp16", *GPT13, 8, "fp16", "dp=1,tp=1,pp=1,zero=0,recompute=none,microbatch=8", False),
    ("g13-mb4x2-none", *GPT13, 8, "bf16", "dp=1,tp=1,pp=1,zero=0,recompute=none,microbatch=4", False),
    ("g13-mb2x4-none", *GPT13, 8, "bf16", "dp=1,tp=1,pp=1,zero=0,recompute=none,microbatch=2", False),
    ("g13-mb1x8-none", *GPT13, 8, "bf16", "dp=1,tp=1,pp=1,zero=0,recompute=none,microbatch=1", False),
    ("g13-mb8-full", *GPT13, 8, "bf16", "dp=1,tp=1,pp=1,zero=0,recompute=full,microbatch=8", False),
    ("g13-searched", *GPT13, 8, "bf16", None, False),
    # the plan `autopar run --cluster local` trains on a GPU (compile chosen): the chosen plan's goal
    ("g13-chosen", *GPT13, 8, "bf16", None, CHOOSE),
    # the search's choice at a batch that fills the GPU's memory: the no-out-of-memory goal on the plan
    # the searcher would hand a user, not only on fixed ones
    ("g13-b32-searched", *GPT13, 32, "bf16", None, False),
    ("g13-mb8-none-compile", *GPT13, 8, "bf16", "dp=1,tp=1,pp=1,zero=0,recompute=none,microbatch=8", True),
    # ZeRO 1 on one GPU (the search skips it: nothing to shard over): FSDP2's mixed precision runs the
    # model in bf16 parameters, no autocast casts and a bf16 residual stream, priced 9% faster eager
    # (281.7 ms against 309.3 on an H200 at 79c242c), and compiled per block under its hooks, which no
    # row has measured yet (267.0 ms against the whole stage's 275.1). What they measure decides
    # whether the search offers it.
    ("g13-mb8-none-zero1", *GPT13, 8, "bf16", "dp=1,tp=1,pp=1,zero=1,recompute=none,microbatch=8", False),
    ("g13-mb8-none-zero1-compile", *GPT13, 8, "bf16", "dp=1,tp=1,pp=1,zero=1,recompute=none,microbatch=8", True),
    # the same plan unpadded: inductor pads misaligned matmuls itself (priced so since 4337bc4), and its
    # losses against the padded row's check the padded-logits mask under inductor
    ("g13-unpadded-compile", "gpt3-1.3b", "vocab_multiple=1", 2048, 8, "bf16",
     "dp=1,tp=1,pp=1,zero=0,recompute=none,microbatch=8", True),
    # a misaligned head as a user's model has it (vocabulary 50,257): padded at runtime (83020cf), and
    # the same plan with the padding turned off, the what-if the cost model prices both ways (the
    # runtime refuses that plan, so the row runs the padded plan with the padding patched out:
    # `unpadded_runtime`, a measurement only)
    ("g13-unpadded-eager", "gpt3-1.3b", "vocab_multiple=1", 2048, 8, "bf16",
     "dp=1,tp=1,pp=1,zero=0,recompute=none,microbatch=8", False),
    ("g13-unpadded-eager-nopad", "gpt3-1.3b", "vocab_multiple=1", 2048, 8, "bf16",
     "dp=1,tp=1,pp=1,zero=0,recompute=none,microbatch=8,gemm_padding=false", False),
    ("g13-mb16-full", *GPT13, 16, "bf16", "dp=1,tp=1,pp=1,zero=0,recompute=full,microbatch=16", False),
    ("g124-fp32-mb8", "gpt2-124m", None, 1024, 8, "fp32", "dp=1,tp=1,pp=1,zero=0,recompute=none,microbatch=8", False),
    ("llama-1.5b-mb4", "llama", "layers=16,hidden=2048,heads=16,kv_heads=8,vocab=128256,seq_len=2048", 2048, 4,
     "bf16", "dp=1,tp=1,pp=1,zero=0,recompute=none,microbatch=4", False),
    ("g27-mb4-full", "gpt3-2.7b", None, 2048, 4, "bf16", "dp=1,tp=1,pp=1,zero=0,recompute=full,microbatch=4", False),
    ("g27-mb4-offload", "gpt3-2.7b", None, 2048, 4, "bf16",
     "dp=1,tp=1,pp=1,zero=3,recompute=full,microbatch=4,offload=optimizer", False),
    # Llama compiled whole (thirteenth session: compile parity on Llama on CPU); last, so that the
    # budget drops it before the rows above
    ("llama-1.5b-mb4-compile", "llama", "layers=16,hidden=2048,heads=16,kv_heads=8,vocab=128256,seq_len=2048",
     2048, 4, "bf16", "dp=1,tp=1,pp=1,zero=0,recompute=none,microbatch=4", True),
]
SMOKE_CONFIG = "layers=2,hidden=64,heads=4,vocab=257,seq_len=64"
SMOKE_PLANS = [
    ("smoke-mb4", "gpt", SMOKE_CONFIG, 64, 4, "fp32", "dp=1,tp=1,pp=1,zero=0,recompute=none,microbatch=4", False),
    ("smoke-searched", "gpt", SMOKE_CONFIG, 64, 4, "fp32", None, False),
]



def make_plans(cases: list[tuple], say, preset: str = "dgx-h100") -> dict[str, dict]:
    """Each case's plan (as JSON) and its prediction for one GPU of `preset`, made on this machine's CPU."""
    import autopar
    from autopar.models import build_model

    cluster = autopar.load_cluster(preset, gpus=1)
    made = {}
    for case, model, config, seq_len, batch, precision, strategy, compile_ in cases:
        started = time.perf_counter()
        if strategy and compile_ is True:  # priced as it runs: the compiled step (gpu_rows.py prices it the same way)
            strategy += ",compile=true"
        spec = build_model(model, config)
        result = autopar.plan(spec.module, spec.example_inputs(1, seq_len), cluster=cluster, global_batch=batch,
                              loss_fn=spec.loss_fn, precision=precision, name=model, seq_len=seq_len,
                              strategy=strategy, choose_compile=compile_ == CHOOSE)
        if result.plan is None:
            made[case] = {"refused": result.no_fit_reason()}
        else:
            predicted = result.plan.predicted
            made[case] = {"plan": result.plan.to_json(), "strategy": result.plan.strategy.model_dump(),
                          "predicted": {"step_time_s": predicted.step_time_s,
                                        "peak_memory_bytes": max(predicted.peak_memory_bytes),
                                        "breakdown": predicted.breakdown}}
        say(f"planned {case} in {time.perf_counter() - started:.1f} s")
    return made


def priced_on_this_host(case: tuple, device: str) -> dict:
    """An offload plan's strategy priced on `--cluster local`, whose host rates are measured here
    (`autopar.host_rates`: the fused CPU AdamW and pinned PCIe copies), beside the preset's DGX host."""
    import autopar
    from autopar.models import build_model

    if device != "cuda":
        return {"status": "skipped: the host is measured against a CUDA device"}
    _, model, config, seq_len, batch, precision, strategy, _ = case
    cluster = autopar.load_cluster("local", gpus=1)
    spec = build_model(model, config)
    result = autopar.plan(spec.module, spec.example_inputs(1, seq_len), cluster=cluster, global_batch=batch,
                          loss_fn=spec.loss_fn, precision=precision, name=model, seq_len=seq_len, strategy=strategy)
    host = {"host_optimizer_params_per_s": cluster.host_optimizer_params_per_s,
            # what the rate times (autopar.host_rates.host_step): "clip+adamw" until af063d4 (a scaling
            # pass, then AdamW), now the norm and AdamW applying the scale
            "host_step": "norm+adamw",
            "host_link_bytes_per_s": cluster.host_link.bandwidth_bytes_per_s}
    if result.plan is None:
        return {"status": f"refused: {result.no_fit_reason()}", **host}
    predicted = result.plan.predicted
    return {"status": "ok", "step_time_s": predicted.step_time_s, "breakdown": predicted.breakdown, **host}
