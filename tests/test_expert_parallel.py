"""Expert parallelism (ep, issue #20 item 1): the zoo's MoE block, its graph facts, costs, ledger,
strategy key, capability table, search, and parity on gloo processes against one process.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import autopar
from autopar.cost_models.collectives import step_collectives
from autopar.cost_models.communication import collective_time_s, group_layout
from autopar.cost_models.backward_memory import loss_gradient_bytes
from autopar.cost_models.evaluate import evaluate, stage_working_bytes
from autopar.cost_models.experts import LOAD_IMBALANCE
from autopar.cost_models.facts import model_facts
from autopar.cost_models.strategy import parse_strategy
from autopar.errors import AutoparError
from autopar.graph.capture import trace
from autopar.graph.moe import expert_capacity
from autopar.models import build_model
from autopar.plan_schema import Strategy, load_plan

from parity_harness import batches, make_plan, reference_run, run_plans, tiny_config
from test_runtime_parity import GLOBAL_BATCH, SEQ, STEPS, _check

E, K = 4, 2
MOE = dict(moe_experts=E, moe_top_k=K, moe_capacity_factor=1.0)  # capacity 8 of 16 tokens: some are dropped
SMALL = dict(layers=2, hidden=32, heads=4, vocab=96, seq_len=16, **MOE)
HIDDEN, CAPACITY = 32, 8  # 4 experts, top 2, factor 1.0: 8 slots per expert for 16 tokens


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def small():
    spec = build_model("gpt", SMALL)
    graph = trace(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, precision="bf16", name="moe")
    return graph, model_facts(graph, heads=4, vocab=96)


EP2 = dict(dp=2, tp=1, pp=1, zero=0, microbatch=2, ep=2)


@pytest.fixture(scope="module")
def ep2_plan():
    """The searcher's plan for ep=2 sharing dp=2 on the tiny MoE GPT (2 layers)."""
    return make_plan("gpt", tiny_config(layers=2, **MOE), EP2, 2, GLOBAL_BATCH)


def _strategy(**keys) -> Strategy:
    return Strategy(**{**dict(dp=2, tp=1, pp=1, zero=0, microbatch=2, num_microbatches=2), **keys})


# --- model and graph facts ---------------------------------------------------------------------

def test_moe_forward_does_not_depend_on_how_the_batch_is_split():
    """Capacity groups are sequences: which tokens drop is the same for any split of the batch."""
    spec = build_model("llama", dict(tiny_config("llama"), **MOE), device="cpu", seed=0)
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))
    whole = spec.module(ids)
    torch.testing.assert_close(torch.cat([spec.module(ids[:1]), spec.module(ids[1:])]), whole, rtol=1e-6, atol=1e-6)


def test_dispatch_fills_queues_first_choices_first_and_drops_past_capacity():
    from autopar.models.moe import dispatch_slots

    chosen = torch.tensor([[0, 0, 1, 0]])  # four (choice, token) entries, capacity 2 per expert
    assert dispatch_slots(chosen, experts=2, capacity=2).tolist() == [[0, 1, 2, 4]]  # the third to expert 0 drops
    assert expert_capacity(16, 4, 2, 1.0) == 8 and expert_capacity(16, 4, 2, None) == 16
    assert expert_capacity(16, 4, 2, 100.0) == 16  # never more slots than tokens


def test_capture_records_each_moe_layer(small):
    graph, facts = small
    assert [layer.module_path for layer in graph.moe_layers] == ["layers.0.mlp", "layers.1.mlp"]
    layer = graph.moe_layers[0]
    capacity = expert_capacity(16, E, K, 1.0)
    assert (layer.experts, layer.top_k, layer.capacity_factor, capacity) == (E, K, 1.0, CAPACITY)
    assert layer.expert_param_elements == E * 2 * HIDDEN * 4 * HIDDEN  # w_in and w_out, ffn 4 × hidden
    assert layer.dispatch_rows_per_sample == E * capacity and layer.autopar_dispatch
    from autopar.cli.inspect import render, summarize

    assert ("mixture of experts: 2 layers (MoE, first layers.0.mlp): 4 experts, top 2, capacity factor 1.0; "
            "65.54 K expert params; 32 rows of 32 per sequence per all-to-all") in render(summarize(graph))
    assert [(x.unit, x.dispatch_bytes_per_sample) for x in facts.experts] == [
        ("layers.0", E * capacity * HIDDEN * 2), ("layers.1", E * capacity * HIDDEN * 2)]  # bf16 rows


# --- costs and ledger --------------------------------------------------------------------------

def test_ep_shards_expert_states_and_prices_the_all_to_alls(small):
    _, facts = small
    cluster = autopar.load_cluster("dgx-h100", gpus=2)
    dense, sharded = evaluate(facts, cluster, _strategy(), 8), evaluate(facts, cluster, _strategy(ep=2), 8)
    expert_elements = sum(x.expert_params for x in facts.experts)
    # without ZeRO, fp32 weights with their bf16 autocast copies (4 + 2 bytes) and two fp32 Adam moments
    # (8; `memory._unsharded_peak`): half the experts
    assert dense.memory[0].parameters - sharded.memory[0].parameters == pytest.approx(expert_elements / 2 * 6)
    assert dense.memory[0].optimizer_states - sharded.memory[0].optimizer_states == pytest.approx(
        expert_elements / 2 * 8)
    dispatch = 2 * E * CAPACITY * HIDDEN * 2  # one all-to-all's buffer for a micro-batch of 2

    def fresh_gradient(evaluation):  # a unit's backward working set (`backward_working_bytes`): accumulating
        # micro-batches, its largest weight's fresh gradient beside its sum (the experts' 1/ep under ep) and
        # its gradients in flight, where it exceeds the loss's gradients and the transients
        s, transient = evaluation.strategy, max(stage.transient_bytes for stage in evaluation.stages)
        return max(0.0, max(loss_gradient_bytes(facts, s), *stage_working_bytes(facts, cluster, s))
                   - transient)

    assert sharded.memory[0].buffers - dense.memory[0].buffers == pytest.approx(
        2 * dispatch + fresh_gradient(sharded) - fresh_gradient(dense))
    assert fresh_gradient(sharded) < fresh_gradient(dense)  # half the stacked experts' gradient
    one = LOAD_IMBALANCE * collective_time_s("all_to_all", dispatch, group_layout(2, 1, 8), cluster)
    # 2 micro-batches x 2 layers x (dispatch + combine) x (forward + backward)
    assert sharded.breakdown["expert_all_to_all"] == pytest.approx(2 * 2 * 2 * 2 * one)
    assert "expert_all_to_all" not in dense.breakdown
    assert sharded.step_time_s > dense.step_time_s - dense.breakdown["exposed_communication"]


def test_all_to_all_crosses_infiniband_once_ep_leaves_the_node(small):
    _, facts = small
    cluster = autopar.load_cluster("dgx-h100", gpus=16)
    strategy = _strategy(dp=16, ep=4, microbatch=1, num_microbatches=1)
    inside, across = (evaluate(facts, cluster, strategy, 16).breakdown["expert_all_to_all"],
                      evaluate(facts, cluster.model_copy(update={"gpus_per_node": 2}), strategy, 16)
                      .breakdown["expert_all_to_all"])
    assert group_layout(4, 1, 8).nodes == 1 and group_layout(4, 1, 2).nodes == 2
    assert across > inside  # the same bytes, partly over the network


def test_ledger_lists_the_all_to_alls_and_the_expert_replicas_sum(small):
    _, facts = small
    stages = [list(facts.units)]
    dense_params = sum(u.params for u in facts.units) - sum(x.expert_params for x in facts.experts)
    expert_local = sum(x.expert_params for x in facts.experts) / 2
    dispatch = 2 * E * CAPACITY * HIDDEN * 2
    ledger = step_collectives(stages, _strategy(dp=4, ep=2), "bf16", 0, seq_len=16, experts=facts.experts)
    assert ledger[("ep", "all_to_all")] == (2 * 2 * 4, 16 * dispatch)
    assert ledger[("dp", "all_reduce")] == (1, dense_params * 4)
    assert ledger[("edp", "all_reduce")] == (1, expert_local * 4)
    shared = step_collectives(stages, _strategy(ep=2), "bf16", 0, seq_len=16, experts=facts.experts)
    assert shared[("dp", "all_to_all")] == (16, 16 * dispatch) and ("edp", "all_reduce") not in shared


def test_zero_shards_expert_states_over_their_replicas(small):
    """ZeRO with ep: dense states over dp, each rank's E/ep expert slices over their dp/ep replicas,
    so expert states end up divided by dp (not by ep × dp, nor only by ep)."""
    _, facts = small
    cluster = autopar.load_cluster("dgx-h100", gpus=4)
    experts = sum(x.expert_params for x in facts.experts)
    for zero, kinds in ((1, ("optimizer_states",)), (2, ("optimizer_states", "gradients")),
                        (3, ("optimizer_states", "gradients", "parameters"))):
        dense = evaluate(facts, cluster, _strategy(dp=4, zero=zero), 8).memory[0]
        sharded = evaluate(facts, cluster, _strategy(dp=4, zero=zero, ep=2), 8).memory[0]
        # what ZeRO shards is the same per rank (E/ep over dp/ep replicas = E/dp); what it keeps whole, ep halves
        for kind in kinds:
            assert getattr(sharded, kind) == pytest.approx(getattr(dense, kind)), (zero, kind)
        if zero < 3:
            assert dense.parameters - sharded.parameters == pytest.approx(experts / 2 * 2)  # bf16 weights
    zero0 = evaluate(facts, cluster, _strategy(dp=4, ep=2), 8).memory[0]
    zero3 = evaluate(facts, cluster, _strategy(dp=4, ep=2, zero=3), 8).memory[0]
    dense = sum(u.params for u in facts.units) - experts
    # ZeRO 0: the rank's fp32 Adam moments (8 bytes; its fp32 weights are the masters), of the dense
    # weights and half the experts; ZeRO 3: 12 bytes sharded, dense over dp = 4, experts over their 2 replicas
    assert zero0.optimizer_states - zero3.optimizer_states == pytest.approx(
        (dense + experts / 2) * 8 - (dense * 12 / 4 + experts / 2 * 12 / 2))


def test_zero3_prices_expert_gathers_on_the_replicas_layout(small):
    """Without overlap, ZeRO-3's exposed traffic is the dense weights over dp plus the expert slices
    over their replicas (ranks ep apart: across nodes once ep × replicas leaves one)."""
    _, facts = small
    experts = sum(x.expert_params for x in facts.experts)
    dense = sum(u.params_on_device(1) for u in facts.units) - experts
    strategy = _strategy(dp=4, ep=2, zero=3, dp_overlap=False)
    for per_node in (8, 2):
        cluster = autopar.load_cluster("dgx-h100", gpus=4).model_copy(update={"gpus_per_node": per_node})
        dp, replicas = group_layout(4, 1, per_node), group_layout(2, 2, per_node)
        gather = (collective_time_s("all_gather", dense * 2, dp, cluster)
                  + collective_time_s("all_gather", experts / 2 * 2, replicas, cluster))
        scatter = (collective_time_s("reduce_scatter", dense * 4, dp, cluster)
                   + collective_time_s("reduce_scatter", experts / 2 * 4, replicas, cluster))
        exposed = evaluate(facts, cluster, strategy, 16).breakdown["exposed_communication"]
        assert exposed == pytest.approx(2 * (gather + gather + scatter))  # 2 micro-batches: forward, backward
    assert replicas.nodes == 2


def test_zero_ledger_gathers_expert_slices_over_their_replicas(small):
    _, facts = small
    stages = [list(facts.units)]
    local = E // 2 * 2 * HIDDEN * 4 * HIDDEN  # a layer's 2 of 4 experts, w_in and w_out
    for zero, gathers, scatters in ((3, 2 * 2, 2), (2, 1, 2), (1, 1, 1)):
        ledger = step_collectives(stages, _strategy(dp=4, ep=2, zero=zero), "bf16", 0, seq_len=16,
                                  experts=facts.experts)
        assert ledger[("edp", "all_gather")] == (2 * gathers, 2 * gathers * local * 2)  # 2 layers, bf16 weights
        assert ledger[("edp", "reduce_scatter")] == (2 * scatters, 2 * scatters * local * 4)  # fp32 gradients
        dense = step_collectives(stages, _strategy(dp=4, zero=zero), "bf16", 0, seq_len=16)
        # dp's units no longer gather the experts: the same calls, the expert bytes gone
        assert ledger[("dp", "all_gather")] == (dense[("dp", "all_gather")][0],
                                                dense[("dp", "all_gather")][1] - 2 * gathers * 2 * local * 2)
    same = step_collectives(stages, _strategy(dp=2, ep=2, zero=3), "bf16", 0, seq_len=16, experts=facts.experts)
    assert not any(axis == "edp" for axis, _ in same)  # ep = dp: the slices have no replicas, FSDP2 sends nothing


# --- strategy, plan file, capability table, search ----------------------------------------------

def test_ep_parses_and_old_plans_load_as_ep_1(tmp_path, ep2_plan):
    assert parse_strategy("dp=4,ep=2") == {"dp": 4, "ep": 2}
    with pytest.raises(AutoparError, match="ep must be at least 1"):
        parse_strategy("ep=0")
    with pytest.raises(ValueError, match="must divide dp"):
        _strategy(dp=2, ep=4)
    plan = ep2_plan
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert load_plan(path).strategy.ep == 2
    assert plan.param_placements["layers.0.mlp.experts.w_in"] == "S(0)R"
    assert plan.param_placements["layers.0.mlp.router.weight"] == "RR"
    data = json.loads(path.read_text())
    del data["strategy"]["ep"]  # a plan written before the field existed
    path.write_text(json.dumps(data))
    assert load_plan(path).strategy.ep == 1


def _plan(model_config: dict, strategy: str | None, gpus: int = 2, batch: int = 8):
    spec = build_model("gpt", model_config)
    return autopar.plan(spec.module, spec.example_inputs(1), cluster=autopar.load_cluster("dgx-h100", gpus=gpus),
                        global_batch=batch, strategy=strategy, loss_fn=spec.loss_fn, name="moe", use_ilp=False)


def test_ep_outside_the_capability_table_is_refused_in_one_line(small):
    from autopar.capabilities import Capabilities
    from autopar.cost_models.experts import expert_parallel_refusal
    from autopar.cost_models.strategy import check_strategy

    runtime = Capabilities(expert_parallel_refusal=expert_parallel_refusal(small[1].experts))
    assert runtime.supports(_strategy(ep=2)) is None and runtime.supports(_strategy(ep=2, recompute="full")) is None
    assert all(runtime.supports(_strategy(ep=2, zero=zero)) is None for zero in (1, 2, 3))
    assert runtime.supports(_strategy(dp=2, pp=2, ep=2, zero=1)) is None
    assert "use zero ≤ 1 with pp > 1" in runtime.supports(_strategy(dp=2, pp=2, ep=2, zero=3))
    assert "use offload=none" in runtime.supports(_strategy(ep=2, zero=3, offload="optimizer"))
    assert "use tp=1 with ep > 1" in runtime.supports(_strategy(dp=2, tp=2, ep=2, microbatch=2))
    assert runtime.supports(_strategy(ep=2, recompute="selective")) is None
    assert "routes its own way" in expert_parallel_refusal([dataclasses.replace(small[1].experts[0],
                                                                                autopar_dispatch=False)])
    with pytest.raises(AutoparError, match="does not divide the 4 experts"):
        check_strategy(_strategy(dp=8, ep=8, num_microbatches=1, microbatch=1), world_size=8, global_batch=8,
                       layers=2, experts=4)


def test_search_offers_ep_only_on_moe_models():
    from autopar.searcher.candidates import completions

    assert {s.ep for s in completions({}, 8, 16, experts=4)} == {1, 2, 4}
    assert {s.ep for s in completions({}, 8, 16)} == {1}


@pytest.mark.slow
def test_search_ranks_ep_plans_and_says_why_not_ep():
    result = _plan(tiny_config(**MOE), "dp=2,zero=0,recompute=none,microbatch=2")
    assert {row.evaluation.strategy.ep for row in result.search.ranked} == {1, 2}
    free = _plan(tiny_config(**MOE), None, gpus=4, batch=16)
    assert any(row.label.startswith("expert parallel (ep=4)") or "expert parallel (ep=4)" in row.label
               for row in free.why_not) or free.plan.strategy.ep == 4


# --- runtime: parity and ledger on gloo processes ------------------------------------------------

def _parity(world: int, strategies: list[dict], family: str = "gpt", plans: list | None = None,
            layers: int = 4, experts: int = E) -> None:
    """Losses within relative 1e-5 of one process, gathered weights within 1e-5, executed placements
    the plan's, and each rank's collectives in a step equal to the plan's ledger (`_check`)."""
    overrides = tiny_config(family, layers=layers, **{**MOE, "moe_experts": experts})
    data = batches(overrides["vocab"], GLOBAL_BATCH, SEQ, STEPS)
    plans = plans or [make_plan(family, overrides, strategy, world, GLOBAL_BATCH) for strategy in strategies]
    jobs = [dict(plan=plan.to_json(), model=family, overrides=overrides, data=data) for plan in plans]
    results = run_plans(world, jobs)
    losses, state = reference_run(family, overrides, data)
    for strategy, plan, ranks in zip(strategies, plans, results):
        _check(strategy, plan, ranks, losses, state)
        axis = "dp" if plan.strategy.ep == plan.strategy.dp else "ep"
        per_layer = 6 if plan.strategy.recompute == "full" else 4  # full recompute resends the forward's two
        for rank in ranks:  # each pipeline rank's layers
            moe = layers // plan.strategy.pp
            assert rank["collectives"][(axis, "all_to_all")][0] == per_layer * moe * plan.strategy.num_microbatches


def test_ep2_shares_dp2_and_trains_like_one_process(ep2_plan):
    _parity(2, [EP2], plans=[ep2_plan], layers=2)


@pytest.mark.slow  # CI time (the 2-core CI machine sits near its 20-minute budget)
def test_ep2_with_zero3_shards_expert_states_and_trains_like_one_process():
    """ZeRO-3 with ep = dp = 2: dense weights sharded over dp by FSDP2, each rank's experts its own
    (their replicas are one rank: FSDP2 sends nothing for them), gradients divided by dp."""
    _parity(2, [dict(EP2, zero=3)], layers=2)


@pytest.mark.slow
def test_ep_times_dp_on_four_processes():
    """ep=2 inside dp=4 (expert replicas summed over 'edp'), ep=4 = dp with full recompute (the forward's
    all-to-alls resent) and with selective recompute (saved, not resent), on Llama's SwiGLU experts."""
    _parity(4, [dict(dp=4, tp=1, pp=1, zero=0, microbatch=1, ep=2),
                dict(dp=4, tp=1, pp=1, zero=0, microbatch=1, ep=4, recompute="full"),
                dict(dp=4, tp=1, pp=1, zero=0, microbatch=1, ep=4, recompute="selective")], family="llama")


@pytest.mark.slow
def test_ep_times_dp_with_zero_on_four_processes():
    """ep=2 inside dp=4 under ZeRO 3, 2 and 1: dense states sharded over dp, each rank's two experts
    sharded on their first dimension over their 2 replicas ('edp' all-gathers and reduce-scatters)."""
    _parity(4, [{"dp": 4, "tp": 1, "pp": 1, "zero": zero, "microbatch": 1, "ep": 2} for zero in (3, 2, 1)])


@pytest.mark.slow
def test_one_expert_per_rank_is_sharded_on_its_hidden_dimension():
    """2 experts, ep=2 inside dp=4, ZeRO 3 on Llama's SwiGLU experts: a rank's single expert cannot split
    over its 2 replicas by experts, so it is sharded on dimension 1 (no padding, as the ledger prices it)."""
    _parity(4, [{"dp": 4, "tp": 1, "pp": 1, "zero": 3, "microbatch": 1, "ep": 2}], family="llama", experts=2)


@pytest.mark.slow
def test_ep_with_pipeline_stages_on_four_processes():
    """pp=2 x dp=2 with ep=2 (1F1B, then GPipe with full recompute, then 1F1B under ZeRO 1): each stage's
    experts over its dp ranks."""
    _parity(4, [dict(dp=2, tp=1, pp=2, zero=0, microbatch=2, ep=2, schedule="1f1b"),
                dict(dp=2, tp=1, pp=2, zero=0, microbatch=2, ep=2, schedule="gpipe", recompute="full"),
                dict(dp=2, tp=1, pp=2, zero=1, microbatch=2, ep=2, schedule="1f1b")])


@pytest.mark.slow
def test_ep_inside_dp_with_zero1_and_pipeline_stages_on_eight_processes():
    """pp=2 x dp=4 with ep=2 under ZeRO 1 (1F1B): torch's stages drive FSDP2, the expert slices' units
    included, gathered and reduced once per step over their 2 replicas ('edp'). About 70 s."""
    _parity(8, [{"dp": 4, "tp": 1, "pp": 2, "zero": 1, "microbatch": 1, "ep": 2, "schedule": "1f1b"}])


# --- what-if and report rows ---------------------------------------------------------------------

@pytest.mark.slow
def test_what_if_prices_ep_and_the_report_shows_the_all_to_all(capsys, tmp_path):
    from autopar.cli import main

    config = "layers=2,hidden=64,heads=4,vocab=128,seq_len=32,moe_experts=4,moe_capacity_factor=1.0"
    with pytest.raises(AutoparError, match="needs mixture-of-experts layers; this model has none"):
        _plan(tiny_config(layers=2), "ep=2")  # the API sets the model's refusal
    code = main(["plan", "--model", "gpt", "--model-config", config, "--cluster", "dgx-h100", "--gpus", "4",
                 "--global-batch", "16", "--strategy", "dp=4,ep=2,zero=0,recompute=none,microbatch=4", "--no-ilp",
                 "--report", str(tmp_path / "plan.html"), "--json", str(tmp_path / "plan.json"),
                 "--trace", str(tmp_path / "plan.trace.json")])
    out = capsys.readouterr().out
    assert code == 0
    assert "experts       ep=2: each MoE layer's experts split over groups of 2 of the 4 dp ranks" in out
    assert "expert all to all" in out and "ep=2" in out.split("--strategy", 1)[1].splitlines()[0]
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["predicted"]["breakdown"]["expert_all_to_all"] > 0
    assert "expert all to all" in (tmp_path / "plan.html").read_text()
    passes = [e for e in json.loads((tmp_path / "plan.trace.json").read_text())["traceEvents"] if e.get("cat") == "forward"]
    assert passes and all("all-to-alls (ep=2)" in e["args"]["includes"] for e in passes)


def test_a_hand_edited_ep_plan_is_refused_against_the_model(ep2_plan):
    from autopar.plan_checks import plan_problem_for_model

    assert plan_problem_for_model(ep2_plan, build_model("gpt", tiny_config(layers=2, **MOE)).module) is None
    dense = build_model("gpt", tiny_config(layers=2)).module
    assert "has no MoE block of the zoo's" in plan_problem_for_model(ep2_plan, dense)
    three = build_model("gpt", tiny_config(layers=2, **{**MOE, "moe_experts": 3})).module
    assert "ep=2 does not divide the 3 experts of layers.0.mlp" in plan_problem_for_model(ep2_plan, three)


def test_run_refuses_checkpoints_under_ep_before_starting(tmp_path, capsys, ep2_plan):
    from autopar.cli import main

    (tmp_path / "plan.json").write_text(ep2_plan.to_json())
    config = ",".join(f"{k}={v}" for k, v in tiny_config(layers=2, **MOE).items())
    code = main(["run", "--model", "gpt", "--model-config", config,
                 "--plan", str(tmp_path / "plan.json"), "--steps", "1", "--checkpoint-dir", str(tmp_path / "ckpt2")])
    err = capsys.readouterr().err
    assert code == 2 and "checkpoints of expert-parallel runs (ep=2) are not implemented yet" in err
    assert not (tmp_path / "ckpt2").exists()


@pytest.mark.slow
def test_hugging_face_moe_blocks_are_graph_facts_and_ep_is_refused_for_them():
    """Mixtral and Qwen2-MoE sparse blocks (dropless: top_k rows per token) are captured as MoE layers;
    the runtime's ep runs the zoo's block only, so the capability table refuses ep for them."""
    transformers = pytest.importorskip("transformers")
    from autopar.cost_models.experts import expert_parallel_refusal
    from autopar.graph.moe import find_moe_layers

    config = transformers.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=32)
    with torch.device("meta"):
        mixtral = transformers.MixtralForCausalLM(config)
    graph = trace(mixtral, torch.zeros(1, 16, dtype=torch.long), precision="bf16",
                  loss_fn=lambda out, ids: out.logits.float().mean())
    layer = graph.moe_layers[0]
    assert (len(graph.moe_layers), layer.module_path, layer.experts, layer.top_k, layer.hidden) == (
        2, "model.layers.0.mlp", 4, 2, 32)
    assert layer.capacity_factor is None and layer.dispatch_rows_per_sample == 2 * 16 and not layer.autopar_dispatch
    assert "routes its own way" in expert_parallel_refusal(model_facts(graph).experts)
    qwen = transformers.Qwen2MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                       max_position_embeddings=32)
    with torch.device("meta"):
        layers = find_moe_layers(transformers.Qwen2MoeForCausalLM(qwen), 16)
    assert [(x.experts, x.top_k, x.hidden) for x in layers] == [(4, 2, 32)] * 2
    assert not any("shared_expert" in name for x in layers for name in x.expert_params)  # dense, not an expert
