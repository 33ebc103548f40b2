"""Context parallelism (cp, issue #20 item 2) outside the runtime: graph facts, the strategy key and
its rules, costs pinned on a tiny Llama (closed forms), the ledger's cp and dp_cp rows as the
cp contract counts them, the capability table, the search's offer rule, plan and report.
"""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.capabilities import RUNTIME_CAPABILITIES
from autopar.cost_models.collectives import step_collectives
from autopar.cost_models.communication import collective_time_s, group_layout
from autopar.cost_models.compute import op_time_s
from autopar.cost_models.context import (AttentionLayer, context_parallel_refusal, exchange_buffer_bytes,
                                         ring_exposed_s)
from autopar.cost_models.backward_memory import loss_gradient_bytes
from autopar.cost_models.evaluate import evaluate, partition, stage_working_bytes
from autopar.cost_models.strategy import check_fixed_degrees, check_strategy, parse_strategy
from autopar.errors import AutoparError
from autopar.plan_schema import Plan, Strategy
from autopar.searcher.candidates import completions, quick_evaluations

LLAMA = "layers=2,hidden=64,heads=4,kv_heads=2,vocab=96,seq_len=32"
S, H, G, D, E = 32, 4, 2, 16, 2  # positions, heads, key/value heads, head dim, bf16 bytes


@pytest.fixture(scope="module")
def llama(zoo_trace):
    _, graph, facts = zoo_trace("llama", LLAMA)
    return graph, facts


def _strategy(**keys) -> Strategy:
    return Strategy(**{**dict(dp=1, tp=1, pp=1, zero=0, microbatch=2, num_microbatches=3), **keys})


def _ledger(facts, s: Strategy) -> dict:
    return step_collectives(partition(facts, 1), s, "bf16", 0, seq_len=S, attention=facts.attention)


def _block(s: Strategy, heads: int) -> float:
    """One rank's K/V (heads=G) or Q (heads=H) block of a micro-batch, by hand."""
    return s.microbatch * S / s.cp * heads / s.tp * D * E


# --- graph facts -----------------------------------------------------------------------------------

def test_capture_records_each_attention_call_with_its_key_value_heads(llama):
    graph, facts = llama
    calls = graph.attention_calls
    assert [c.module_path for c in calls] == ["layers.0.attn", "layers.1.attn"]
    assert {(c.heads, c.kv_heads, c.head_dim, c.seq_len, c.causal, c.autopar_attention) for c in calls} == {
        (H, G, D, S, True, True)}  # kv heads as projected, before the grouped-query repeat
    assert [(a.unit, a.element_bytes) for a in facts.attention] == [("layers.0", E), ("layers.1", E)]


# --- strategy key and rules ------------------------------------------------------------------------

def test_strategy_key_product_rule_and_divisibility_errors():
    assert parse_strategy("cp=8,cp_kind=ulysses") == {"cp": 8, "cp_kind": "ulysses"}
    with pytest.raises(AutoparError, match="ring, ulysses"):
        parse_strategy("cp_kind=zigzag")
    with pytest.raises(AutoparError, match="cp_kind=ulysses splits sequences over cp > 1"):
        check_fixed_degrees({"cp": 1, "cp_kind": "ulysses"}, 8)
    with pytest.raises(AutoparError, match="dp×cp×tp×pp = dp=2×cp=2×tp=1×pp=1 = 4 but the cluster has 8"):
        check_fixed_degrees({"dp": 2, "cp": 2, "tp": 1, "pp": 1}, 8)
    check_fixed_degrees({"dp": 2, "cp": 2, "tp": 2, "pp": 1}, 8)

    def check(s: Strategy, world: int) -> None:
        check_strategy(s, world_size=world, global_batch=6, layers=2, heads=H, kv_heads=G, seq_len=S)

    with pytest.raises(AutoparError, match="dp×cp×tp×pp = 1×2×1×1 = 2 but the cluster has 4 GPUs"):
        check(_strategy(cp=2), 4)
    with pytest.raises(AutoparError, match="ring cuts the sequence into 2×cp = 6 equal chunks, and 32 positions"):
        check(_strategy(cp=3), 3)
    with pytest.raises(AutoparError, match="ulysses splits the 2 key/value heads over tp×cp = 1×4"):
        check(_strategy(cp=4, cp_kind="ulysses"), 4)
    with pytest.raises(AutoparError, match="ulysses splits the 2 key/value heads over tp×cp = 2×2"):
        check(_strategy(cp=2, tp=2, cp_kind="ulysses"), 4)
    check(_strategy(cp=2, cp_kind="ulysses"), 2)
    check(_strategy(cp=16), 16)  # 2×16 chunks of one position each


# --- ledger ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("recompute, per_layer", [("none", 20), ("selective", 20), ("full", 26)])
def test_ring_ledger_counts_the_contracts_sends_and_receives(llama, recompute, per_layer):
    """Per layer and micro-batch at cp=4: forward 2(cp−1) = 6, backward 2(cp−1) + 2cp = 14, a fully
    recomputed layer its forward's 6 again; each of one K/V block."""
    _, facts = llama
    s = _strategy(cp=4, recompute=recompute)
    block = _block(s, G)
    assert block == 2 * 8 * 2 * 16 * 2
    ledger = _ledger(facts, s)
    calls = 3 * 2 * per_layer  # micro-batches × layers × per layer
    assert ledger[("cp", "send")] == ledger[("cp", "recv")] == (calls, pytest.approx(calls * block))


@pytest.mark.parametrize("recompute, passes", [("none", 2), ("full", 3)])
def test_ulysses_ledger_counts_four_all_to_alls_per_pass(llama, recompute, passes):
    _, facts = llama
    s = _strategy(cp=2, cp_kind="ulysses", recompute=recompute)
    query, block = _block(s, H), _block(s, G)
    ledger = _ledger(facts, s)
    assert ledger[("cp", "all_to_all")] == (3 * 2 * 4 * passes, pytest.approx(3 * 2 * passes * (2 * query + 2 * block)))
    assert ("cp", "send") not in ledger


def test_gradient_sync_and_zero3_span_dp_times_cp(llama):
    _, facts = llama
    units = list(facts.units)
    plain = _ledger(facts, _strategy(dp=4))
    split = _ledger(facts, _strategy(dp=1, cp=4))
    grads = sum(u.trainable_on_device(1) for u in units) * 4  # fp32 reduction
    assert split[("dp_cp", "all_reduce")] == plain[("dp", "all_reduce")] == (1, pytest.approx(grads))
    assert not any(axis == "dp" for axis, _ in split)
    zero3 = {kind: value for (axis, kind), value in _ledger(facts, _strategy(dp=2, cp=2, zero=3)).items()
             if axis == "dp_cp"}
    assert zero3 == {kind: value for (axis, kind), value in _ledger(facts, _strategy(dp=4, zero=3)).items()
                     if axis == "dp"}  # FSDP2 over the 4 ranks either way: the same gathers and scatters
    assert _ledger(facts, _strategy(cp=1)) == {k: v for k, v in plain.items() if k[0] == "world"}


def test_tp_reductions_under_cp_are_a_ranks_positions(zoo_trace):
    """tp beside cp: a rank reduces the rows of its S/cp positions of each sequence, so cp=2 with
    micro-batches of 2 reduces what cp=1 with micro-batches of 1 does, less half of GPT's position-table
    lookup (one lookup of the rank's positions per micro-batch, whatever the batch)."""
    _, _, facts = zoo_trace("gpt", "layers=2,hidden=32,heads=4,vocab=96,seq_len=16")
    stages = partition(facts, 1)
    table = sum(op.reduce_bytes for unit in facts.units for op in unit.forward_ops if op.reduce_per_microbatch)
    assert table == 16 * 32 * 2  # the [S, hidden] bf16 position rows, all-reduced over tp

    def tp_reduce(s: Strategy) -> tuple[int, float]:
        return step_collectives(stages, s, "bf16", 0, seq_len=16)[("tp", "all_reduce")]

    split, whole = tp_reduce(_strategy(tp=2, cp=2, microbatch=2)), tp_reduce(_strategy(tp=2, microbatch=1))
    assert split[0] == whole[0] and split[1] == pytest.approx(whole[1] - 3 * table / 2)  # 3 micro-batches


# --- costs -----------------------------------------------------------------------------------------

def test_ring_exposed_time_is_what_the_transfer_exceeds_the_chunk_attention():
    transfer = lambda size: 1e-6 + size / 1e9  # noqa: E731  (a link: 1 µs, 1 GB/s)
    block = 1e6
    forward, backward = ring_exposed_s(4, transfer, block, attention_forward_s=4e-3, attention_backward_s=8e-3)
    assert forward == pytest.approx(3 * (2.001e-3 - 1e-3))  # (cp−1)·(t(2B) − a_f/cp)
    assert backward == pytest.approx(3 * (4.001e-3 - 2e-3) + 2.001e-3)  # (cp−1)·(t(4B) − a_b/cp) + t(2B)
    hidden = ring_exposed_s(4, transfer, block, attention_forward_s=1.0, attention_backward_s=1.0)
    assert hidden == (0.0, pytest.approx(2.001e-3))  # only the dK/dV homecoming stays


def test_evaluate_prices_the_ring_exchange_by_hand(llama):
    _, facts = llama
    cluster = autopar.load_cluster("dgx-h100", gpus=4)
    s = _strategy(cp=4)
    evaluation = evaluate(facts, cluster, s, 6)
    layout = group_layout(4, 1, 8)
    assert layout.nodes == 1

    def transfer(size: float) -> float:
        return collective_time_s("send_recv", size, layout, cluster)

    expected = 0.0
    for unit in facts.units:
        if unit.layer_type is None:
            continue
        forward, backward = (sum(op_time_s(op, cluster.gpu, "bf16", batch=s.microbatch / 4, tp=1, sp=False)
                                 for op in ops if op.kind == "attention") for ops in (unit.forward_ops,
                                                                                      unit.backward_ops))
        block = _block(s, G)
        expected += 3 * (max(0.0, transfer(2 * block) - forward / 4) + max(0.0, transfer(4 * block) - backward / 4))
        expected += transfer(2 * block)
    assert evaluation.breakdown["context_exchange"] == pytest.approx(3 * expected)  # × 3 micro-batches


def test_evaluate_prices_ulysses_all_to_alls_exposed(llama):
    _, facts = llama
    cluster = autopar.load_cluster("dgx-h100", gpus=2)
    s = _strategy(cp=2, cp_kind="ulysses", recompute="full")
    layout = group_layout(2, 1, 8)
    one_pass = sum(2 * collective_time_s("all_to_all", _block(s, heads), layout, cluster) for heads in (H, G))
    # 3 micro-batches × 2 layers × (forward + backward + the forward's again under full recompute)
    assert evaluate(facts, cluster, s, 6).breakdown["context_exchange"] == pytest.approx(3 * 2 * 3 * one_pass)


def test_activations_divide_by_cp_and_the_ring_adds_its_blocks(llama):
    _, facts = llama
    cluster = autopar.load_cluster("dgx-h100", gpus=4)
    whole, split = evaluate(facts, cluster, _strategy(dp=4), 24), evaluate(facts, cluster, _strategy(cp=4), 6)
    assert split.memory[0].activations == pytest.approx(whole.memory[0].activations / 4)
    ring_blocks = 8 * _block(_strategy(cp=4), G)  # K, V, dK, dV in use and four arriving

    def loss_buffer(evaluation):  # the cross entropy's gradients at the head, a rank's 1/cp of the positions,
        # or a unit's backward working set (`backward_working_bytes`: its gradients in flight, a weight's
        # fresh gradient beside its accumulated one), the larger
        transient = max(stage.transient_bytes for stage in evaluation.stages)
        s = evaluation.strategy
        return max(0.0, max(loss_gradient_bytes(facts, s), *stage_working_bytes(facts, cluster, s)) - transient)

    assert split.memory[0].buffers - whole.memory[0].buffers == pytest.approx(
        ring_blocks + loss_buffer(split) - loss_buffer(whole))
    assert exchange_buffer_bytes(facts.attention, [u.name for u in facts.units], _strategy(cp=4)) == ring_blocks
    sharded = evaluate(facts, cluster, _strategy(cp=4, zero=3), 6).memory[0]
    plain = evaluate(facts, cluster, _strategy(dp=4, zero=3), 24).memory[0]
    assert sharded.parameters == pytest.approx(plain.parameters)


def test_a_rank_computes_its_share_of_the_positions(llama):
    """Per-token work and causal attention both divide by cp: at cp=4 a rank's micro-batch of 4
    sequences costs what one sequence costs without cp (the zigzag balances the triangle)."""
    _, facts = llama
    cluster = autopar.load_cluster("dgx-h100", gpus=4)
    split = evaluate(facts, cluster, _strategy(cp=4, microbatch=4), 12)
    one = evaluate(facts, cluster, _strategy(microbatch=1), 3)
    assert split.breakdown["compute"] == pytest.approx(one.breakdown["compute"])
    assert split.stages[0].activation_bytes == pytest.approx(one.stages[0].activation_bytes)


# --- capability table and search ---------------------------------------------------------------------

def test_capability_table_refuses_what_the_runtime_cannot_run_with_cp():
    supports = RUNTIME_CAPABILITIES.supports
    assert supports(_strategy(cp=2, dp=2, zero=3)) is None and supports(_strategy(cp=2, tp=2)) is None
    for keys, words in [(dict(pp=2), "pp=1"), (dict(tp=2, sp=True), "sp=false"),
                        (dict(dp=2, zero=1), "zero=0 or zero=3"), (dict(dp=2, zero=2), "not zero=2"),
                        (dict(dp=2, ep=2), "ep=1"), (dict(zero=3, offload="optimizer"), "offload=none")]:
        assert words in supports(_strategy(cp=2, **keys)), keys
    own = AttentionLayer("layers.0", H, G, D, S, True, False, E)
    zoo = AttentionLayer("layers.0", H, G, D, S, True, True, E)
    assert "leave cp out" in context_parallel_refusal([own], False)
    assert "mixture-of-experts" in context_parallel_refusal([zoo], True)
    assert "no attention call" in context_parallel_refusal([], False)
    assert context_parallel_refusal([zoo], False) is None


def test_search_offers_cp_for_long_sequences_only(zoo_trace):
    assert {(s.cp, s.cp_kind) for s in completions({}, 8, 8, seq_len=4096)} == {(1, "ring")}
    offered = {(s.cp, s.cp_kind) for s in completions({}, 8, 8, seq_len=16384)}
    assert offered == {(1, "ring")} | {(cp, kind) for cp in (2, 4, 8) for kind in ("ring", "ulysses")}
    assert {s.cp for s in completions({"cp": 2}, 8, 8, seq_len=64)} == {2}  # --strategy cp=N at any length
    _, _, long = zoo_trace("llama", "layers=1,hidden=64,heads=8,kv_heads=8,vocab=96,seq_len=16384", batch=1)
    cluster = autopar.load_cluster("dgx-h100", gpus=4)
    quick, _, _ = quick_evaluations(long, cluster, {}, 4, layers=1, supports=RUNTIME_CAPABILITIES.supports)
    assert {e.strategy.cp for e in quick} == {1, 2, 4}


def test_plan_with_cp_carries_the_axis_devices_ledger_and_report(zoo_trace):
    from autopar.plan_schema import parse_placements
    from autopar.report import render_html, render_text, render_trace

    spec, _, _ = zoo_trace("llama", LLAMA)
    cluster = autopar.load_cluster("dgx-h100", gpus=4)
    result = autopar.plan(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, cluster=cluster, global_batch=8,
                          strategy="cp=2,dp=2,zero=3,recompute=none", seq_len=S)
    plan = result.plan
    assert [(a.name, a.size) for a in plan.mesh] == [("pp", 1), ("dp", 2), ("cp", 2), ("tp", 1)]
    assert plan.stages[0].mesh_shape == {"dp": 2, "cp": 2, "tp": 1} and plan.stages[0].device_ids == [0, 1, 2, 3]
    assert {len(parse_placements(text)) for text in plan.param_placements.values()} == {3}
    assert set(plan.param_placements.values()) == {"S(0)S(0)R"}  # ZeRO-3 over dp × cp, no tp
    kinds = {(r.axis, r.kind) for r in plan.predicted.collectives[0]}
    assert {("cp", "send"), ("cp", "recv"), ("dp_cp", "all_gather"), ("dp_cp", "reduce_scatter")} <= kinds
    assert not any(axis == "dp" for axis, _ in kinds)
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="mesh axis cp=1 but strategy.cp=2"):
        Plan.model_validate({**json.loads(plan.to_json()),
                             "mesh": [{"name": "pp", "size": 1}, {"name": "dp", "size": 2}, {"name": "tp", "size": 2}]})
    assert "no context parallel (cp=1)" in " / ".join(row.label for row in result.why_not)
    report = result.summary()
    text = render_text(report)
    assert "tp=1 × cp=2 × pp=1 × dp=2 = 4 GPUs" in text and "context       cp=2 ring" in text
    assert "context exchange" in text and "over dp × cp" in text
    assert 'id="context-cost"' in render_html(report)
    other = json.loads(render_trace(report))["otherData"]
    assert other["context_exchange_s"] == pytest.approx(report.predicted.breakdown.context_exchange) and \
        other["context_exchange_s"] > 0


def test_why_not_names_the_best_cp_plan_when_cp_loses(zoo_trace):
    """A long sequence on a model small enough for dp alone: cp is offered, loses, and a row says by how much."""
    spec, _, _ = zoo_trace("llama", "layers=1,hidden=64,heads=8,kv_heads=8,vocab=96,seq_len=16384", batch=1)
    result = autopar.plan(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, global_batch=4, seq_len=16384,
                          cluster=autopar.load_cluster("dgx-h100", gpus=4))
    assert result.plan.strategy.cp == 1
    rows = [row for row in result.why_not if "context parallel (cp=" in row.label]
    assert len(rows) == 1 and rows[0].strategy.cp > 1 and rows[0].slowdown >= 1
    assert "slower" in rows[0].reason or "as fast" in rows[0].reason
