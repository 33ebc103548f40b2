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
    ours = sum(autocast_bytes(graph).values()) / _traced_vector_bytes(graph)
    _, _, torch_ratio = counted.compare(family, config, 2, 128)
    assert ours == pytest.approx(torch_ratio, rel=0.03)
    assert ours > 1.05  # a step under autocast moves more: a count that changed nothing would fail


def test_rules_on_the_gpt_block():
    _, graph, _ = traced_zoo("gpt", CASES[0][1], batch=2)
    moved = autocast_bytes(graph)
    nodes = {n.name: n for n in graph.nodes}
    norms = [n for n in graph.nodes if op_packet(n) == "native_layer_norm"]
    for norm in norms:  # the residual stream and the norm's output are fp32: twice the 16-bit bytes
        assert moved[norm.name] == pytest.approx(2 * (norm.bytes_read + norm.bytes_written - 4 * 256), rel=0.02)
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
    assert all(nodes[name].phase in ("forward", "backward") for name in moved)


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
