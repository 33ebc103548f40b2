"""The bytes the cost model gives each op under autocast (`cost_models.autocast`), against torch's own
step run both ways on fake tensors and counted op by op (`benchmarks/autocast_bytes.py`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autopar.cost_models.autocast import (CAST_BYTES, autocast_activation_factor, autocast_bytes,
                                          autocast_saved_bytes)
from autopar.cost_models.compute import DEFAULT_EFFICIENCY, Efficiency, op_time_s
from autopar.cost_models.tp_shards import op_packet
from autopar.graph.ir import DTYPE_BYTES
from tests.conftest import traced_zoo

CASES = [("gpt", "layers=2,hidden=256,heads=4,vocab=1000,seq_len=128"),
         ("llama", "layers=2,hidden=256,heads=4,kv_heads=2,vocab=1000,seq_len=128")]


@pytest.fixture
def counted(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import autocast_bytes as counted

    return counted


def _traced_vector_bytes(graph) -> float:
    """The 16-bit trace's vector-op bytes, parameters' reads left out (what facts price)."""
    param_bytes = {p.name: p.numel * DTYPE_BYTES[p.dtype] for p in graph.params}
    return sum(max(n.bytes_read + n.bytes_written - sum(param_bytes.get(p, 0) for p in n.params), 0)
               for n in graph.nodes if not n.is_view and not n.flops)


@pytest.mark.parametrize("family,config", CASES)
def test_the_graph_count_matches_torch_run_under_autocast(counted, family, config):
    """The ratio of autocast's bytes to the trace's, from the graph alone, within 3% of the ratio
    torch's own two steps give (the fake count also reads whole embedding tables, which the facts
    price as weights: so ratios, not totals, are compared)."""
    _, graph, _ = traced_zoo(family, config, batch=2)
    ours = sum(op.moved_bytes for op in autocast_bytes(graph).values()) / _traced_vector_bytes(graph)
    _, _, torch_ratio = counted.compare(family, config, 2, 128)
    assert ours == pytest.approx(torch_ratio, rel=0.03)
    assert ours > 1.05  # a step under autocast moves more: a count that changed nothing would fail


@pytest.mark.parametrize("family,config", CASES)
def test_each_op_kind_matches_torch_run_under_autocast(counted, family, config):
    """Op kind by op kind, forward and backward together, within 5% of torch's count for every kind
    that moves 2% of the bytes or more: errors in the backward rules cannot hide in a total. The
    casts before products are `_to_copy` kernels in torch's count; embeddings are left out (the
    fake count reads the whole table, which the facts price as weights)."""
    _, graph, _ = traced_zoo(family, config, batch=2)
    moved = autocast_bytes(graph)
    ours: dict[str, float] = {}
    for node in graph.nodes:
        if node.name in moved:
            packet = "_to_copy" if node.flops else op_packet(node)
            ours[packet] = ours.get(packet, 0.0) + moved[node.name].moved_bytes
    torch_bytes = counted.step_bytes(family, config, 2, 128, autocast=True)
    total = sum(torch_bytes.values())
    checked = [packet for packet, moved in torch_bytes.items()
               if moved >= 0.02 * total and not packet.startswith("embedding")]
    assert len(checked) >= 6
    for packet in checked:
        assert ours.get(packet, 0.0) == pytest.approx(torch_bytes[packet], rel=0.05), packet


def test_rules_on_the_gpt_block():
    _, graph, _ = traced_zoo("gpt", CASES[0][1], batch=2)
    moved = {name: op.moved_bytes for name, op in autocast_bytes(graph).items()}
    param_bytes = {p.name: p.numel * DTYPE_BYTES[p.dtype] for p in graph.params}
    norms = [n for n in graph.nodes if op_packet(n) == "native_layer_norm"]
    for norm in norms:  # the residual stream and the norm's output are fp32: twice the 16-bit bytes
        activations = norm.bytes_read + norm.bytes_written - sum(param_bytes[p] for p in norm.params)
        assert moved[norm.name] == pytest.approx(2 * activations, rel=0.02)
    # each forward projection reading a norm's fp32 output casts it first (q, k, v: three casts)
    q_proj = next(n for n in graph.nodes if n.phase == "forward" and op_packet(n) == "addmm"
                  and n.module_path.endswith("attn.q_proj"))
    activation = q_proj.input_meta[1]  # addmm(bias, input, weightᵀ)
    assert moved[q_proj.name] == activation.numel * CAST_BYTES
    # the GELU between two GEMMs stays 16-bit; so does the fused attention, which casts nothing
    gelu = next(n for n in graph.nodes if op_packet(n) == "gelu")
    assert moved[gelu.name] == gelu.bytes_read + gelu.bytes_written
    attention = next(n for n in graph.nodes if "flash_attention" in n.op and n.phase == "forward")
    assert moved[attention.name] == 0


def test_the_model_s_own_casts_of_an_fp32_value_are_no_kernels():
    """Llama's RMSNorm casts its input up (`x.float()`) and back (`.to(x.dtype)`): under autocast the
    residual is fp32 already, so neither cast nor their backward casts run; the logits' `.float()`
    (a 16-bit GEMM output) and its backward do."""
    _, graph, _ = traced_zoo("llama", CASES[1][1], batch=2)
    ops = autocast_bytes(graph)
    casts = [n for n in graph.nodes if op_packet(n) == "_to_copy"]
    layer_casts = [n for n in casts if n.layer is not None]
    assert layer_casts and all(ops[n.name].kernels == 0 and ops[n.name].moved_bytes == 0 for n in layer_casts)
    head_casts = [n for n in casts if n.layer is None and n.output_meta[0].shape[-1] >= 1000]  # the logits
    assert {n.phase for n in head_casts} == {"forward", "backward"}
    assert all(ops[n.name].kernels == 1 and ops[n.name].moved_bytes > 0 for n in head_casts)


def test_fp32_traces_have_nothing_to_cast():
    assert autocast_bytes(traced_zoo("gpt", CASES[0][1], batch=2, precision="fp32")[1]) == {}


def test_autocast_prices_the_counted_bytes_only_when_asked():
    """A vector op under autocast is priced at its counted bytes, a GEMM pays its input casts on top;
    without the switch (ZeRO 3, Megatron's 16-bit weights) both are priced as traced."""
    from autopar.cluster import load_cluster

    _, _, facts = traced_zoo("gpt", CASES[0][1], batch=2)
    gpu = load_cluster("dgx-h100", gpus=1).gpu
    plain = Efficiency(launch_overhead_s=0.0)
    under = Efficiency(launch_overhead_s=0.0, autocast=True)
    ops = [op for unit in facts.units for op in unit.ops]
    norm = next(op for op in ops if op.name.startswith("native_layer_norm") and op.phase == "forward")
    gemm = next(op for op in ops if op.kind == "matmul" and op.phase == "forward" and op.autocast_bytes)

    def price(op, efficiency):
        return op_time_s(op, gpu, "bf16", batch=4, tp=1, sp=False, efficiency=efficiency)

    bandwidth = gpu.hbm_bandwidth_bytes_per_s * plain.memory
    assert price(norm, under) == pytest.approx((norm.autocast_bytes * 4 + norm.weight_bytes) / bandwidth)
    assert price(norm, under) > 1.9 * price(norm, plain)
    assert price(gemm, under) - price(gemm, plain) == pytest.approx(gemm.autocast_bytes * 4 / bandwidth)
    assert DEFAULT_EFFICIENCY.autocast is False  # the stage pricing sets it per plan


def _layer_saved(graph, saved, layer):
    return (sum(n.saved_bytes for n in graph.nodes if n.layer == layer),
            sum(saved.get(n.name, 0.0) for n in graph.nodes if n.layer == layer))


# Per token and hidden unit (n = b·s·h), what a layer keeps in the 16-bit trace and how much more under
# autocast. GPT: each LayerNorm's input is the fp32 residual (+2n twice), and the q, k and v projections
# each keep their own cast of the first norm's fp32 output where the trace keeps one tensor (+4n);
# MemTracker measured 40 against 32 (`memory.AUTOCAST_ACTIVATION_FACTOR`). Llama: its RMSNorm casts its
# input up and back, in the trace fp32 copies kept apart (two of 4n each, and the 16-bit result, 2n),
# under autocast the fp32 residual itself (counted once, charged to the norm's cast in the layer that
# reads it, as the trace charges its copy) and the fp32 normalized value (4n); its q, k, v keep three
# casts (+4n), gate and up two (+2n): net +2n over 56n, a factor of 1.04 where the GPT's is 1.25.
BLOCKS = [("gpt", 32, 8), ("llama", 56, 2)]


@pytest.mark.parametrize("family,traced_per_n,extra_per_n", BLOCKS)
def test_what_a_block_keeps_under_autocast(family, traced_per_n, extra_per_n):
    config = dict(CASES)[family]
    _, graph, facts = traced_zoo(family, config, batch=2)
    saved = autocast_saved_bytes(graph)
    n = 2 * 128 * 256
    for layer in ("layers.0", "layers.1"):
        traced, autocast = _layer_saved(graph, saved, layer)
        assert traced / n == pytest.approx(traced_per_n, rel=0.01)
        assert (autocast - traced) / n == pytest.approx(extra_per_n, rel=0.01)
    factor = (traced_per_n + extra_per_n) / traced_per_n
    assert autocast_activation_factor(graph) == pytest.approx(factor, rel=0.01)
    assert facts.autocast_activation_factor == autocast_activation_factor(graph)


def test_an_fp32_trace_has_no_autocast_count_and_memory_falls_back_to_the_measured_factor():
    from autopar.cost_models.memory import AUTOCAST_ACTIVATION_FACTOR, activation_factor

    _, graph, facts = traced_zoo("gpt", CASES[0][1], batch=2, precision="fp32")
    assert autocast_saved_bytes(graph) == {} and facts.autocast_activation_factor is None
    assert all(op.autocast_saved_bytes is None for unit in facts.units for op in unit.ops)
    assert all(unit.autocast_input_bytes is None for unit in facts.units)
    assert activation_factor("bf16", 0, "none", "fp32") == AUTOCAST_ACTIVATION_FACTOR  # traced bytes
    assert activation_factor("bf16", 0, "none", "fp32", autocast_counted=True) == 1.0  # counted already
    assert activation_factor("bf16", 3, "none", "fp32") == 1.0  # 16-bit weights: as traced


@pytest.mark.parametrize("family,config", CASES)
def test_a_plan_keeps_each_policy_s_bytes_at_autocast_s_dtypes(family, config):
    """Without ZeRO the activations are counted at autocast's dtypes, policy by policy: none keeps
    every op's autocast bytes (a layer's: the model's factor times its traced bytes); full recompute
    the layer's input, the fp32 residual (twice the traced bf16 input); selective that input and every
    product's outputs, which the runtime's policy caches (`runtime.recompute`), read by backward or not."""
    from autopar.cost_models.stage_costs import unit_activation_bytes

    _, graph, facts = traced_zoo(family, config, batch=2)
    layer = facts.units[facts.layer_units[0]]
    traced_none = unit_activation_bytes(layer, 2, 1, False, "none")
    assert unit_activation_bytes(layer, 2, 1, False, "none", autocast=True) == pytest.approx(
        sum(op.autocast_saved_bytes for op in layer.forward_ops) * 2)
    assert unit_activation_bytes(layer, 2, 1, False, "full", autocast=True) == pytest.approx(
        2 * unit_activation_bytes(layer, 2, 1, False, "full")) == pytest.approx(2 * layer.input_bytes * 2)
    products = sum(max(op.output_bytes, op.autocast_saved_bytes) for op in layer.forward_ops
                   if op.kind in ("matmul", "attention"))
    assert unit_activation_bytes(layer, 2, 1, False, "selective", autocast=True) == pytest.approx(
        (products + layer.autocast_input_bytes) * 2)
    outputs = [op for op in layer.forward_ops if op.kind == "matmul"]
    assert len(outputs) >= 6 and all(op.output_bytes > 0 for op in outputs)  # q, k, v, o, and the MLP's
    assert traced_none < unit_activation_bytes(layer, 2, 1, False, "none", autocast=True)


def test_a_plan_s_memory_uses_its_model_s_autocast_count():
    """The activations of a plan without ZeRO are counted at autocast's dtypes (no factor on top), and
    the allocator's slack applies to everything held; a Llama keeps less per traced byte than a GPT."""
    from autopar.cluster import load_cluster
    from autopar.cost_models.evaluate import evaluate
    from autopar.cost_models.memory import UNSHARDED_ALLOCATOR_SLACK
    from autopar.cost_models.strategy import Strategy

    one = Strategy(dp=1, tp=1, pp=1, microbatch=2, num_microbatches=1)
    per_traced = {}
    for family, config in CASES:
        _, _, facts = traced_zoo(family, config, batch=2)
        evaluation = evaluate(facts, load_cluster("dgx-h100", gpus=1), one, 2)
        assert evaluation.autocast_activations
        assert evaluation.activation_scale == pytest.approx(1 + UNSHARDED_ALLOCATOR_SLACK)
        memory = evaluation.memory[0]
        held = memory.parameters + memory.gradients + memory.optimizer_states + memory.buffers + memory.activations
        assert memory.total_bytes == pytest.approx(held * (1 + UNSHARDED_ALLOCATOR_SLACK))
        traced = evaluate(dataclasses.replace(facts, autocast_activation_factor=None),
                          load_cluster("dgx-h100", gpus=1), one, 2).memory[0].activations
        per_traced[family] = memory.activations / traced
    assert 1.0 < per_traced["llama"] < per_traced["gpt"]


def test_a_shared_cost_cache_keeps_counted_and_uncounted_activations_apart():
    """Compiled whole, recompute none prices min-cut's ratio on the traced bytes; with recompute the
    same units are counted at autocast's dtypes. A cache shared by both (the search's, its floors
    first) must not hand one plan the other's activation bytes."""
    from autopar.cluster import load_cluster
    from autopar.cost_models.evaluate import evaluate
    from autopar.cost_models.stage_costs import CostCache
    from autopar.cost_models.strategy import Strategy

    _, _, facts = traced_zoo("gpt", CASES[0][1], batch=2)
    cluster = load_cluster("dgx-h100", gpus=1)
    compiled = Strategy(dp=1, tp=1, pp=1, microbatch=2, num_microbatches=1, compile=True)
    selective = compiled.model_copy(update={"recompute": "selective"})
    fresh = evaluate(facts, cluster, selective, 2).memory[0].activations
    shared = CostCache()
    evaluate(facts, cluster, compiled, 2, cache=shared)
    assert evaluate(facts, cluster, selective, 2, cache=shared).memory[0].activations == fresh


def test_a_what_if_implementation_prices_its_new_ops_uncounted():
    """`attention=math` adds ops (fp32 scores under autocast) the count never saw: the facts it returns
    carry no count, so memory falls back to the traced bytes times the measured factor."""
    from autopar.cost_models.implementation import as_run

    _, _, facts = traced_zoo("gpt", CASES[0][1], batch=2)
    assert facts.autocast_activation_factor is not None
    assert as_run(facts, "math").autocast_activation_factor is None
