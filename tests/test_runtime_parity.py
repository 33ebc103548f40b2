"""Parity: each plan kind trains like one process (same model, data, seed; fp32, gloo).

Every loss matches the single-process reference to relative 1e-5 and the gathered final weights
to 1e-5; every parameter runs with the placement the plan gives it; every rank's collectives in a
step (kind, calls and bytes per mesh axis) are those the plan predicted.
"""

from __future__ import annotations

import pytest
import torch

from parity_harness import batches, make_plan, reference_run, run_plans, tiny_config

STEPS = 5
GLOBAL_BATCH = 8
SEQ = 16


def _cases(model: str, overrides: dict, strategies: list[dict], world: int):
    data = batches(overrides["vocab"], GLOBAL_BATCH, SEQ, STEPS)
    plans = [make_plan(model, overrides, strategy, world, GLOBAL_BATCH) for strategy in strategies]
    jobs = [dict(plan=plan.to_json(), model=model, overrides=overrides, data=data) for plan in plans]
    results = run_plans(world, jobs)
    reference_losses, reference_state = reference_run(model, overrides, data)
    return plans, results, reference_losses, reference_state


def _check(strategy, plan, ranks, reference_losses, reference_state):
    label = ",".join(f"{k}={v}" for k, v in strategy.items())
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference_losses),
                                   rtol=1e-5, atol=0, msg=lambda m: f"{label} rank {rank} losses: {m}")
        for name, placement in result["placements"].items():
            assert plan.param_placements[name] == placement, (label, rank, name, placement)
        _check_collectives(label, plan, result)
    state = {}
    for result in ranks:
        state.update(result.get("state", {}))
    assert set(state) == set(reference_state), (label, set(reference_state) ^ set(state))
    for name, value in state.items():
        torch.testing.assert_close(value, reference_state[name], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{label} weight {name}: {m}")


def _check_collectives(label: str, plan, result: dict) -> None:
    """What the rank sent in a step (kind, calls, bytes per mesh axis) is what the plan predicted."""
    from autopar.cost_models.collectives import merge_world

    predicted = {(r.axis, r.kind): (r.calls, r.bytes) for r in plan.predicted.collectives[result["pp_rank"]]}
    predicted = merge_world(predicted, {axis.name: axis.size for axis in plan.mesh})
    executed = result["collectives"]
    assert set(executed) == set(predicted), (label, sorted(executed), sorted(predicted))
    for key, (calls, size) in predicted.items():
        assert executed[key] == (calls, round(size)), (label, key, "executed", executed[key], "predicted", (calls, size))


WORLD2_GPT = [
    dict(dp=2, tp=1, pp=1, zero=0, microbatch=2),
    dict(dp=2, tp=1, pp=1, zero=1, microbatch=2),
    dict(dp=2, tp=1, pp=1, zero=2, microbatch=2),
    dict(dp=2, tp=1, pp=1, zero=3, microbatch=2),
    dict(dp=2, tp=1, pp=1, zero=0, microbatch=2, recompute="full"),
    dict(dp=1, tp=2, pp=1, zero=0, microbatch=4),
    dict(dp=1, tp=2, pp=1, sp=True, zero=0, microbatch=4),
    dict(dp=1, tp=2, pp=1, zero=0, microbatch=4, recompute="selective"),
    dict(dp=1, tp=1, pp=2, schedule="gpipe", microbatch=2),
    dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2),
    dict(dp=1, tp=1, pp=2, schedule="interleaved", vp=2, microbatch=2),
    dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2, recompute="full"),
    # per-layer recompute: only the first layers of each stage (the ledger resends only theirs)
    dict(dp=1, tp=2, pp=1, zero=0, microbatch=4, recompute="full", recompute_layers=(2,)),
    dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2, recompute="selective", recompute_layers=(1, 0)),
]


def test_world2_gpt_plan_kinds():
    plans, results, losses, state = _cases("gpt", tiny_config(), WORLD2_GPT, world=2)
    for strategy, plan, ranks in zip(WORLD2_GPT, plans, results):
        if "recompute_layers" in strategy:  # the plan lists the first layers of each stage, no more
            first = [path for stage, k in zip(plan.stages, strategy["recompute_layers"])
                     for path in [p for p in stage.module_paths if p.startswith("layers.")][:k]]
            assert plan.recompute_modules == first, (plan.recompute_modules, first)
        _check(strategy, plan, ranks, losses, state)


WORLD2_LLAMA = [
    dict(dp=1, tp=2, pp=1, sp=True, zero=0, microbatch=4),
    dict(dp=2, tp=1, pp=1, zero=3, microbatch=4),
    dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2),
]


def test_world2_llama_plan_kinds():
    plans, results, losses, state = _cases("llama", tiny_config("llama"), WORLD2_LLAMA, world=2)
    for strategy, plan, ranks in zip(WORLD2_LLAMA, plans, results):
        _check(strategy, plan, ranks, losses, state)


REGATHERED = [
    dict(dp=1, tp=2, pp=1, sp=True, zero=0, microbatch=4, sp_inputs="regathered"),
    # layer 0 recomputed keeps what its checkpoint keeps; layer 1 keeps shards and gathers them again
    dict(dp=1, tp=2, pp=1, sp=True, zero=0, microbatch=4, recompute="full", recompute_layers=(1,),
         sp_inputs="regathered"),
]


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_sequence_shards_kept_and_gathered_again(model):
    """`sp_inputs=regathered`: blocks keep their input's sequence shard and gather it again in backward
    (one more all-gather per block and micro-batch, in the ledger); Llama's q, k and v share one gather."""
    strategies = REGATHERED if model == "gpt" else REGATHERED[:1]
    plans, results, losses, state = _cases(model, tiny_config(model), strategies, world=2)
    for strategy, plan, ranks in zip(strategies, plans, results):
        assert plan.strategy.sp_inputs == "regathered"
        _check(strategy, plan, ranks, losses, state)


WORLD4_GPT = [
    dict(dp=2, tp=2, pp=1, zero=0, microbatch=2),
    dict(dp=2, tp=2, pp=1, sp=True, zero=3, microbatch=2),
    dict(dp=2, tp=1, pp=2, schedule="1f1b", zero=0, microbatch=2),
    dict(dp=2, tp=1, pp=2, schedule="gpipe", zero=1, microbatch=2),
    dict(dp=1, tp=2, pp=2, schedule="1f1b", sp=True, zero=0, microbatch=2),
]


# ~40 s on 4 processes; world-4 tp x dp, pp x dp and pp x tp stay in the default set through
# test_world4_placed_plans_with_data_and_pipeline_parallelism and test_world4_llama_tensor_and_pipeline_parallel.
@pytest.mark.slow
def test_world4_gpt_combinations():
    plans, results, losses, state = _cases("gpt", tiny_config(), WORLD4_GPT, world=4)
    for strategy, plan, ranks in zip(WORLD4_GPT, plans, results):
        _check(strategy, plan, ranks, losses, state)


WORLD4_LLAMA = [
    dict(dp=1, tp=2, pp=2, schedule="1f1b", zero=0, microbatch=2),
    # sequence shards kept across pipeline stages, which hand on plain local shards
    dict(dp=1, tp=2, pp=2, schedule="1f1b", sp=True, zero=0, microbatch=2, sp_inputs="regathered"),
]


def test_world4_llama_tensor_and_pipeline_parallel():
    """Megatron layout over two pipeline ranks: each block's backward all-reduce is on the rank holding
    the block (RMSNorm's elementwise backward must not carry it into the previous stage's ledger)."""
    plans, results, losses, state = _cases("llama", tiny_config("llama"), WORLD4_LLAMA, world=4)
    for strategy, plan, ranks in zip(WORLD4_LLAMA, plans, results):
        assert not plan.op_placements  # the graph propagation's plan, not the ILP's
        _check(strategy, plan, ranks, losses, state)


WORLD8_GPT = [
    dict(dp=2, tp=2, pp=2, schedule="1f1b", sp=True, zero=1, microbatch=1),
    dict(dp=2, tp=2, pp=2, schedule="interleaved", vp=2, sp=False, zero=1, microbatch=1, recompute="full"),
]


@pytest.mark.slow
def test_world8_gpt_pipeline_data_tensor_parallel():
    plans, results, losses, state = _cases("gpt", tiny_config(), WORLD8_GPT, world=8)
    for strategy, plan, ranks in zip(WORLD8_GPT, plans, results):
        _check(strategy, plan, ranks, losses, state)


def test_a_plan_outside_the_capability_table_is_refused_before_any_collective():
    """The searcher never offers what the table lacks; a forged plan gets one line, not a hang."""
    from autopar.errors import AutoparError
    from autopar.models import build_model
    from autopar.runtime.parallelize import parallelize

    plan = make_plan("gpt", tiny_config(), dict(dp=1, tp=1, pp=2, schedule="interleaved", vp=2, microbatch=2), 2,
                     GLOBAL_BATCH)
    forged = plan.model_copy(update={"strategy": plan.strategy.model_copy(update={"vp": 16})})
    spec = build_model("gpt", tiny_config())
    with pytest.raises(AutoparError, match="cannot run: the runtime runs at most 8 virtual stages"):
        parallelize(spec.module, forged, loss_fn=spec.loss_fn)


def test_intra_op_ilp_plan_runs_as_planned():
    """With the ILP on, the searcher keeps only placements the runtime executes, and they train like one
    process, sending the collectives their placements imply (not those of the Megatron layout)."""
    strategy = dict(dp=1, tp=2, pp=1, microbatch=4)
    data = batches(tiny_config()["vocab"], GLOBAL_BATCH, SEQ, STEPS)
    plan = make_plan("gpt", tiny_config(), strategy, 2, GLOBAL_BATCH, use_ilp=True)
    assert plan.op_placements, "the ILP's placements were expected in the plan"
    results = run_plans(2, [dict(plan=plan.to_json(), model="gpt", overrides=tiny_config(), data=data)])
    losses, state = reference_run("gpt", tiny_config(), data)
    _check(strategy, plan, results[0], losses, state)


# --- plans with per-parameter placements (the ILP's kind): the ledger follows the placements -------

def _searched(model: str, overrides: dict, strategy: dict, world: int):
    """The ILP search's chosen candidate and what `build_plan` needs with it (as `make_plan`, use_ilp=True)."""
    import autopar
    from autopar.models import build_model

    spec = build_model(model, overrides)
    planned = autopar.plan(spec.module, spec.example_inputs(1), cluster=autopar.load_cluster("dgx-h100", gpus=world),
                           global_batch=GLOBAL_BATCH, strategy=strategy, loss_fn=spec.loss_fn, precision="fp32",
                           name=model, seq_len=spec.config.seq_len, use_ilp=True)
    result, graph, facts, cluster = planned.search, planned.graph, planned.facts, planned.cluster
    chosen = result.best or result.ranked[0]
    assert chosen.op_placements, "the ILP's candidate was expected to win on the tiny model"
    return chosen, graph, facts, cluster, spec.module


def _placed_plan(model: str, overrides: dict, strategy: dict, world: int, placements: dict[str, str]):
    """The searched ILP candidate with its tp placements replaced by `placements` (others R), built by
    `build_plan` as any ILP plan: the ledger comes from the placements alone."""
    import dataclasses

    from autopar.runtime.tensor_parallel.realization import capabilities_for
    from autopar.searcher.plan_builder import build_plan
    from autopar.searcher.tp_placements import executed_tp_placements

    chosen, graph, facts, cluster, module = _searched(model, overrides, strategy, world)
    placements = {p.name: placements.get(p.name, "R") for p in graph.params}
    assert capabilities_for(module).check_placements(executed_tp_placements(placements)) is None
    return build_plan(dataclasses.replace(chosen, param_placements=placements), graph, facts, cluster)


def _differs_from_megatron(model: str, plan) -> bool:
    from autopar.runtime.tensor_parallel.module_rules import tp_placement

    megatron = make_plan(model, tiny_config(model), dict(dp=1, tp=2, pp=1, microbatch=4), 2, GLOBAL_BATCH)
    return any(tp_placement(plan.param_placements[name]) != tp_placement(text)
               for name, text in megatron.param_placements.items())


def _layer_placements(layers: dict[int, tuple[str, ...]], blocks: dict[str, tuple[list[str], list[str]]],
                      bias: bool) -> dict[str, str]:
    """Column (S(0), bias too) and row (S(1)) placements for the named blocks of each layer."""
    placements = {}
    for layer, names in layers.items():
        for name in names:
            columns, rows = blocks[name]
            for column in columns:
                placements[f"layers.{layer}.{name}.{column}.weight"] = "S(0)"
                if bias:
                    placements[f"layers.{layer}.{name}.{column}.bias"] = "S(0)"
            for row in rows:
                placements[f"layers.{layer}.{name}.{row}.weight"] = "S(1)"
    return placements


GPT_BLOCKS = {"attn": (["q_proj", "k_proj", "v_proj"], ["out_proj"]), "mlp": (["fc1"], ["fc2"])}
LLAMA_BLOCKS = {"attn": (["q_proj", "k_proj", "v_proj"], ["out_proj"]),
                "mlp": (["gate_proj", "up_proj"], ["down_proj"])}
# Layouts the Megatron propagation never makes: attention sharded over a replicated MLP (its
# all-reduce then resent by full recompute), single blocks, replicated layers, a hidden-sharded
# embedding (an all-gather), a vocabulary-parallel head over partly replicated layers.
GPT_ATTENTION_ONLY = {**_layer_placements({i: ("attn",) for i in range(4)}, GPT_BLOCKS, bias=True),
                      "embed.weight": "S(0)"}
GPT_MIXED = {**_layer_placements({0: ("mlp",), 2: ("attn", "mlp"), 3: ("attn",)}, GPT_BLOCKS, bias=True),
             "pos_embed.weight": "S(1)"}
LLAMA_MIXED = {**_layer_placements({0: ("attn",), 1: ("attn",), 2: ("mlp",), 3: ("attn", "mlp")}, LLAMA_BLOCKS,
                                   bias=False), "embed.weight": "S(1)", "head.weight": "S(0)"}


def _placed_cases(world: int, cases: list[tuple[str, dict, dict | None]]):
    """Plans of `cases` (model, strategy, placements; None: the ILP's own), run on `world` processes."""
    plans = [make_plan(model, tiny_config(model), strategy, world, GLOBAL_BATCH, use_ilp=True) if placements is None
             else _placed_plan(model, tiny_config(model), strategy, world, placements)
             for model, strategy, placements in cases]
    data = {model: batches(tiny_config(model)["vocab"], GLOBAL_BATCH, SEQ, STEPS) for model, _, _ in cases}
    jobs = [dict(plan=plan.to_json(), model=model, overrides=tiny_config(model), data=data[model])
            for plan, (model, _, _) in zip(plans, cases)]
    results = run_plans(world, jobs)
    references = {model: reference_run(model, tiny_config(model), batches_) for model, batches_ in data.items()}
    for plan, ranks, (model, strategy, placements) in zip(plans, results, cases):
        assert plan.op_placements, (model, strategy)
        if placements is not None:  # the ILP's own choice may be any layout; these never are Megatron's
            assert _differs_from_megatron(model, plan), (model, strategy)
        _check(strategy, plan, ranks, *references[model])


def test_world2_placed_plans_send_what_their_placements_imply():
    """Single blocks, replicated layers, sharded embeddings and heads, full recompute over a sharded
    attention and a replicated MLP: each trains like one process and sends what its ledger lists."""
    _placed_cases(2, [
        ("gpt", dict(dp=1, tp=2, pp=1, microbatch=4, recompute="full"), GPT_ATTENTION_ONLY),
        ("gpt", dict(dp=1, tp=2, pp=1, microbatch=2), GPT_MIXED),
        ("llama", dict(dp=1, tp=2, pp=1, microbatch=4, recompute="full"), LLAMA_MIXED),
        ("llama", dict(dp=1, tp=2, pp=1, microbatch=4), None),
    ])


def test_world4_placed_plans_with_data_and_pipeline_parallelism():
    """With dp (gradient and FSDP sizes follow the placements) and pp (each block's backward all-reduce
    on the rank holding the block: LLaMA's norms would let the graph propagation defer it a stage)."""
    _placed_cases(4, [
        ("gpt", dict(dp=2, tp=2, pp=1, zero=3, microbatch=2), GPT_MIXED),
        ("gpt", dict(dp=1, tp=2, pp=2, schedule="1f1b", microbatch=2, recompute="full"), GPT_ATTENTION_ONLY),
        ("llama", dict(dp=1, tp=2, pp=2, schedule="1f1b", microbatch=2), LLAMA_MIXED),
        ("gpt", dict(dp=2, tp=2, pp=1, zero=0, microbatch=2), None),
    ])


def test_placement_check_names_what_the_runtime_cannot_chain():
    from autopar.models import build_model
    from autopar.runtime.tensor_parallel.module_rules import check_tp_placements
    from autopar.runtime.tensor_parallel.realization import capabilities_for

    module = build_model("gpt", tiny_config()).module
    check = capabilities_for(module).check_placements
    megatron = {"layers.0.attn.q_proj.weight": "S(0)", "layers.0.attn.q_proj.bias": "S(0)",
                "layers.0.attn.k_proj.weight": "S(0)", "layers.0.attn.k_proj.bias": "S(0)",
                "layers.0.attn.v_proj.weight": "S(0)", "layers.0.attn.v_proj.bias": "S(0)",
                "layers.0.attn.out_proj.weight": "S(1)"}
    assert check(megatron) is None
    assert check({}) is None  # all replicated
    assert "mixes tensor-parallel linears" in check({**megatron, "layers.0.attn.out_proj.weight": "R"})
    assert "bias" in check({**megatron, "layers.0.attn.q_proj.bias": "R"})
    swapped_mlp = {"layers.0.mlp.fc1.weight": "S(1)", "layers.0.mlp.fc2.weight": "S(0)", "layers.0.mlp.fc2.bias": "S(0)"}
    assert "row-parallel linear before a column-parallel one" in check({**megatron, **swapped_mlp})
    assert check({**megatron, "layers.0.mlp.fc1.weight": "S(0)", "layers.0.mlp.fc1.bias": "S(0)",
                  "layers.0.mlp.fc2.weight": "S(1)"}) is None
    assert "only Linear and Embedding" in check_tp_placements(module, {"layers.0.ln1.weight": "S(0)"}, sp=False)
    assert "head" in check({"embed.weight": "S(1)"})  # tied to the head: a row-parallel head fails at its first step


def test_world2_plan_the_ilp_chose_under_the_runtime_rules_trains_like_one_process():
    """Wide enough that the ILP (restricted to what the runtime runs) shards the blocks but keeps the
    embedding replicated where Megatron's propagation would split it over the vocabulary: that plan,
    as searched, trains like one process and sends what its ledger lists."""
    from autopar.runtime.tensor_parallel.module_rules import tp_placement

    overrides = dict(layers=2, hidden=256, heads=4, vocab=512, seq_len=128)
    strategy = dict(dp=1, tp=2, pp=1, sp=False, microbatch=8)
    plan = make_plan("gpt", overrides, strategy, 2, GLOBAL_BATCH, use_ilp=True)
    megatron = make_plan("gpt", overrides, strategy, 2, GLOBAL_BATCH)
    assert plan.op_placements and not megatron.op_placements  # the ILP's plan won; the other is Megatron's
    differing = {name for name, text in plan.param_placements.items()
                 if tp_placement(text) != tp_placement(megatron.param_placements[name])}
    assert differing, "the ILP's plan is Megatron's layout"
    assert tp_placement(plan.param_placements["layers.0.mlp.fc2.weight"]) == "S(1)"  # blocks still sharded
    data = batches(overrides["vocab"], GLOBAL_BATCH, overrides["seq_len"], 3)
    (ranks,) = run_plans(2, [dict(plan=plan.to_json(), model="gpt", overrides=overrides, data=data)])
    _check(strategy, plan, ranks, *reference_run("gpt", overrides, data))
