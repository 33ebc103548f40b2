"""The bytes the cost model gives each op under autocast (`cost_models.autocast`), against torch's own
step run both ways on fake tensors and counted op by op (`benchmarks/autocast_bytes.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopar.cost_models.autocast import CAST_BYTES, autocast_bytes
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
