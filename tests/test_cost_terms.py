"""Issue #18's cost terms on small closed-form cases: collective latency that grows with ranks and
nodes, GEMM efficiency monotone in size, the per-layer fixed overhead, the implementation profile
(`--strategy attention/dropout/dp_overlap/tp_overlap/optimizer_state/zero3_fetch`), the planner's memory
headroom, and the published-run accountings the validation benchmark divides by."""

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

from autopar.capabilities import RUNTIME_CAPABILITIES
from autopar.cluster import load_cluster
from autopar.errors import AutoparError
from autopar.graph import trace
from autopar.models import build_model
from autopar.plan_schema import Strategy
from autopar.cost_models.communication import (RING_BASE_LATENCY_S, TREE_STEP_LATENCY_S, collective_time_s,
                                               group_layout, ring_latency_s)
from autopar.cost_models.compute import (FITTED_EFFICIENCY, Efficiency, gemm_efficiency, op_time_s, ridge_point,
                                         unit_fixed_overhead_s)
from autopar.cost_models.evaluate import evaluate
from autopar.cost_models.facts import model_facts
from autopar.cost_models.implementation import as_run
from autopar.cost_models.memory import planning_capacity_bytes, state_bytes_per_param
from autopar.cost_models.strategy import parse_strategy

H100 = load_cluster("dgx-h100", gpus=8)
A100 = load_cluster("dgx-a100-80gb", gpus=8)
CONFIG = {"layers": 4, "hidden": 512, "heads": 8, "vocab": 4096, "seq_len": 512}


def traced(attention="fused", dropout=0.0, precision="fp16"):
    spec = build_model("gpt", {**CONFIG, "dropout": dropout})
    graph = trace(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, precision=precision, attention=attention)
    return model_facts(graph, heads=CONFIG["heads"], vocab=CONFIG["vocab"])


@pytest.fixture(scope="module")
def plain():
    return traced()


# --- collective latency ---------------------------------------------------------------------------
def test_ring_latency_is_a_base_plus_one_link_latency_per_step():
    nvlink = H100.intra_node.latency_s
    for n in (2, 4, 8):
        layout = group_layout(n, 1, 8)
        assert ring_latency_s("all_reduce", layout, H100) == pytest.approx(RING_BASE_LATENCY_S + 2 * (n - 1) * nvlink)
        assert ring_latency_s("all_gather", layout, H100) == pytest.approx(RING_BASE_LATENCY_S + (n - 1) * nvlink)


def test_a_tiny_collective_costs_more_with_more_ranks_and_more_nodes():
    big = load_cluster("dgx-h100", gpus=1024)
    # one rank per node (stride 8), 2..128 nodes: every step crosses the network
    times = [collective_time_s("all_gather", 1024.0, group_layout(n, 8, 8), big) for n in (2, 8, 32, 128)]
    assert times == sorted(times) and times[-1] > 10 * times[0]
    inside = [collective_time_s("all_reduce", 1024.0, group_layout(n, 1, 8), big) for n in (2, 4, 8)]
    assert inside == sorted(inside) and inside[0] < inside[-1]
    # the same 8 ranks inside a node are quicker than spread over 8 nodes
    assert collective_time_s("all_reduce", 1024.0, group_layout(8, 8, 8), big) > inside[-1]


def test_a_small_all_reduce_over_many_nodes_takes_the_tree():
    big = load_cluster("dgx-h100", gpus=1024)
    layout = group_layout(128, 8, 8)  # 128 nodes, one rank each
    ring = ring_latency_s("all_reduce", layout, big)
    tree = 2 * math.log2(128) * TREE_STEP_LATENCY_S
    assert tree < ring
    assert collective_time_s("all_reduce", 1024.0, layout, big) == pytest.approx(tree, rel=0.01)
    # and a large one the ring: its bandwidth is the better one
    large = collective_time_s("all_reduce", 2e9, layout, big)
    assert large < 2e9 * 2 / big.inter_node.effective_bandwidth_bytes_per_s / 0.92 + tree


# --- GEMM efficiency by shape ---------------------------------------------------------------------
def test_gemm_efficiency_is_monotone_in_every_dimension_and_reaches_the_ceiling():
    ceiling, half = 0.8, 128.0
    sizes = [16, 64, 128, 512, 2048, 8192, 65536]
    for axis in (1, 2, 3):
        values = []
        for size in sizes:
            dims = [1.0, 4096.0, 4096.0, 4096.0]
            dims[axis] = float(size)
            values.append(gemm_efficiency(tuple(dims), ceiling, half))
        assert values == sorted(values) and values[-1] < ceiling
    assert gemm_efficiency((1.0, 128.0, 1e9, 1e9), ceiling, half) == pytest.approx(ceiling / 2, rel=1e-6)
    assert gemm_efficiency((1.0, 1e9, 1e9, 1e9), ceiling, half) == pytest.approx(ceiling, rel=1e-5)
    assert gemm_efficiency((1.0, 64.0, 64.0, 64.0), ceiling, 0.0) == ceiling  # no shape term: the ceiling


def test_a_small_matmul_runs_further_below_peak_than_a_large_one(plain):
    efficiency = Efficiency(gemm_half_ridges=1.0, layer_overhead_s=0.0, launch_overhead_s=0.0)
    op = next(op for op in plain.units[plain.layer_units[0]].ops if op.kind == "matmul" and op.gemm is not None)
    peak = H100.gpu.peak_flops_per_s("fp16")

    def achieved(batch, tp):
        flops = op.flops * batch / (tp if op.tp_sharded else 1)
        return flops / op_time_s(op, H100.gpu, "fp16", batch=batch, tp=tp, sp=False, efficiency=efficiency) / peak

    assert achieved(1, 8) < achieved(1, 1) < achieved(16, 1) <= efficiency.matmul_for(H100.gpu)


def test_the_gemm_half_dimension_is_a_multiple_of_the_gpus_own_ridge_point():
    """Datasheet ridges (peak FLOP/s over HBM bytes/s): A100-80GB 312e12/2039e9, H100 989e12/3350e9."""
    a100, h100 = A100.gpu, H100.gpu
    assert ridge_point(a100, "fp16") == pytest.approx(312e12 / 2039e9)
    assert ridge_point(h100, "bf16") == pytest.approx(989e12 / 3350e9)
    efficiency = Efficiency(gemm_half_ridges=2.0)
    assert efficiency.gemm_half_dim_for(h100, "bf16") == pytest.approx(2 * 989e12 / 3350e9)
    # the same GEMM runs further below its ceiling on the GPU with the higher ridge
    dims = (1.0, 8192.0, 1024.0, 8192.0)
    share = [gemm_efficiency(dims, 1.0, efficiency.gemm_half_dim_for(gpu, "bf16")) for gpu in (a100, h100)]
    assert share[1] < share[0] < 1.0
    # a dimension of exactly one half-dimension (the others unbounded) halves the ceiling, on either GPU
    for gpu in (a100, h100):
        half = efficiency.gemm_half_dim_for(gpu, "bf16")
        assert gemm_efficiency((1.0, half, 1e12, 1e12), 0.8, half) == pytest.approx(0.4, rel=1e-6)
    assert Efficiency().gemm_half_dim_for(h100, "bf16") == 0.0  # no shape term unless given


def test_the_layer_overhead_is_charged_once_per_layer_and_pass(plain):
    base = Strategy(dp=8, tp=1, pp=1, microbatch=2, num_microbatches=1)
    without = evaluate(plain, H100, base, 16, efficiency=Efficiency(layer_overhead_s=0.0))
    with_it = evaluate(plain, H100, base, 16, efficiency=Efficiency(layer_overhead_s=1e-3))
    layers = len(plain.layer_units)
    assert with_it.breakdown["compute"] - without.breakdown["compute"] == pytest.approx(2 * layers * 1e-3)
    assert unit_fixed_overhead_s(plain.units[plain.layer_units[0]], Efficiency(layer_overhead_s=1e-3)) == 2e-3
    assert unit_fixed_overhead_s(plain.units[0], Efficiency(layer_overhead_s=1e-3)) == 0.0  # the embedding


# --- implementation profile -----------------------------------------------------------------------
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_priced_math_attention_and_dropout_match_the_traced_graph(plain, recompute):
    """`attention=math,dropout=0.1` on a fused graph prices what tracing the unfused, dropout model gives."""
    unfused = traced(attention="math", dropout=0.1)
    # as the published runs that need these knobs ran: 16-bit weights, no autocast (the runtime
    # refuses attention=math, so autocast's fp32 softmax is never priced for it)
    s = Strategy(dp=2, tp=2, pp=2, microbatch=2, num_microbatches=4, recompute=recompute, weight_passes=False)
    as_traced = evaluate(unfused, A100, s, 16)
    as_priced = evaluate(plain, A100, s.model_copy(update={"attention": "math", "dropout": 0.1}), 16)
    # 5%: the traced unfused model also copies its heads' transposes (three `clone`s a layer, 12
    # kernels more than the priced ones), and this tiny model's step is mostly per-kernel time. The
    # kernels' own work agrees to 1.5%.
    assert as_priced.step_time_s == pytest.approx(as_traced.step_time_s, rel=0.05)
    no_launches = dataclasses.replace(FITTED_EFFICIENCY, launch_overhead_s=0.0)
    assert evaluate(plain, A100, s.model_copy(update={"attention": "math", "dropout": 0.1}), 16,
                    efficiency=no_launches).step_time_s == pytest.approx(
        evaluate(unfused, A100, s, 16, efficiency=no_launches).step_time_s, rel=0.015)
    # (the traced graph counts a dropout's mask into the next layer's input: full recompute keeps 3% more)
    assert as_priced.memory[0].activations == pytest.approx(as_traced.memory[0].activations, rel=0.04)
    fused = evaluate(plain, A100, s, 16)
    assert as_priced.step_time_s > fused.step_time_s  # materialized scores cost time


def test_the_profile_is_parsed_refused_by_the_runtime_and_applied_once(plain):
    fixed = parse_strategy("attention=math,dropout=0.1,dp_overlap=false,tp_overlap=true,sp=true,optimizer_state=bf16")
    assert fixed == {"attention": "math", "dropout": 0.1, "dp_overlap": False, "tp_overlap": True, "sp": True,
                     "optimizer_state": "bf16"}
    for bad in ("attention=flashy", "dropout=1.5", "dp_overlap=maybe", "optimizer_state=fp8"):
        with pytest.raises(AutoparError):
            parse_strategy(bad)
    with pytest.raises(ValueError, match="needs sp"):
        Strategy(dp=1, tp=2, pp=1, microbatch=1, num_microbatches=1, tp_overlap=True)
    s = Strategy(dp=8, tp=1, pp=1, microbatch=1, num_microbatches=1, attention="math")
    assert "attention=math" in RUNTIME_CAPABILITIES.supports(s)
    assert RUNTIME_CAPABILITIES.supports(s.model_copy(update={"attention": "fused"})) is None
    once = as_run(plain, "math", 0.1)
    assert as_run(once, "math", 0.1) is once and as_run(plain, "fused", 0.0) is plain
    with pytest.raises(AutoparError, match="already runs dropout"):
        as_run(traced(dropout=0.1), "fused", 0.1)


def test_overlap_knobs_move_communication_as_stated(plain):
    cluster = load_cluster("dgx-h100", gpus=16)
    s = Strategy(dp=16, tp=1, pp=1, microbatch=4, num_microbatches=1, zero=1)  # gradients: several buckets
    overlapped = evaluate(plain, cluster, s, 64)
    after = evaluate(plain, cluster, s.model_copy(update={"dp_overlap": False}), 64)
    assert after.breakdown["exposed_communication"] > overlapped.breakdown["exposed_communication"]
    assert after.breakdown["compute"] == pytest.approx(overlapped.breakdown["compute"])
    s = Strategy(dp=2, tp=8, pp=1, sp=True, microbatch=4, num_microbatches=2, zero=1)
    overlapped = evaluate(plain, cluster, s, 16)
    tp_hidden = evaluate(plain, cluster, s.model_copy(update={"tp_overlap": True}), 16)
    assert tp_hidden.step_time_s < overlapped.step_time_s
    exposed = overlapped.breakdown["exposed_communication"] - tp_hidden.breakdown["exposed_communication"]
    assert 0 < exposed < overlapped.breakdown["exposed_communication"]  # at least one chunk stays exposed


def test_zero3_fetch_per_parameter_pays_each_tensors_gather_and_holds_one_tensor(plain):
    """`zero3_fetch=parameter` (DeepSpeed 0.3): one unoverlapped all-gather per parameter tensor and
    use, twice in a fully recomputed unit's backward; its latency grows with the dp ranks; the
    device holds the largest tensor gathered, not a unit."""
    from autopar.cost_models.stage_costs import CostCache, Pricing, largest_fetch, parameter_fetch_s

    def fetch_s(gpus: int, policy: str) -> tuple[float, float]:
        cluster = load_cluster("dgx-a100-80gb", gpus=gpus)
        s = Strategy(dp=gpus, tp=1, pp=1, microbatch=1, num_microbatches=1, zero=3, zero3_fetch="parameter")
        layout = group_layout(gpus, 1, 8)
        pricing = Pricing(facts=plain, cluster=cluster, strategy=s, efficiency=Efficiency(), cache=CostCache(),
                          tp_layout=group_layout(1, 1, 8), dp_layout=layout)
        got = parameter_fetch_s(pricing, plain.units, [policy] * len(plain.units), 2)
        want = sum(collective_time_s("all_gather", math.prod(shape) * 2, layout, cluster)
                   for unit in plain.units for shape, _ in unit.param_shapes)
        assert got == pytest.approx((want, want * (2 if policy == "full" else 1)))
        return got

    assert fetch_s(64, "full")[1] == pytest.approx(2 * fetch_s(64, "none")[1])
    assert fetch_s(16, "none")[0] < fetch_s(64, "none")[0] < fetch_s(256, "none")[0]  # latency grows with ranks
    layer = next(u for u in plain.units if u.layer_type)
    s = Strategy(dp=8, tp=1, pp=1, microbatch=1, num_microbatches=1, zero=3)
    assert largest_fetch(layer, s) == layer.params_on_device(1)
    per_tensor = largest_fetch(layer, s.model_copy(update={"zero3_fetch": "parameter"}))
    assert per_tensor == max(math.prod(shape) for shape, _ in layer.param_shapes) < layer.params_on_device(1)
    cluster = load_cluster("dgx-a100-80gb", gpus=64)
    s = Strategy(dp=64, tp=1, pp=1, microbatch=1, num_microbatches=1, zero=3, dp_overlap=False)
    fsdp = evaluate(plain, cluster, s, 64)
    deepspeed = evaluate(plain, cluster, s.model_copy(update={"zero3_fetch": "parameter"}), 64)
    assert deepspeed.step_time_s > fsdp.step_time_s and deepspeed.memory[0].buffers < fsdp.memory[0].buffers
    other_software = deepspeed.strategy.model_copy(update={"dp_overlap": True})
    assert "zero3_fetch=parameter" in RUNTIME_CAPABILITIES.supports(other_software)
    assert parse_strategy("zero3_fetch=parameter") == {"zero3_fetch": "parameter"}


def test_bf16_optimizer_state_holds_eight_bytes_per_parameter(plain):
    assert state_bytes_per_param("bf16", "bf16").optimizer == 8
    assert state_bytes_per_param("bf16").optimizer == 12
    # ZeRO 1: Megatron-style states (bf16 weights beside fp32 masters); without ZeRO the runtime's
    # autocast over fp32 weights holds no separate master (`memory._autocast_peak`)
    s = Strategy(dp=8, tp=1, pp=1, zero=1, microbatch=1, num_microbatches=2)
    fp32 = evaluate(plain, H100, s, 16).memory[0]
    bf16 = evaluate(plain, H100, s.model_copy(update={"optimizer_state": "bf16"}), 16).memory[0]
    assert bf16.optimizer_states == pytest.approx(fp32.optimizer_states * 8 / 12)


# --- memory headroom ------------------------------------------------------------------------------
def test_the_search_keeps_the_headroom_and_reports_it():
    from autopar.report.build import evaluation_report
    from autopar.searcher.search import search

    spec = build_model("gpt", CONFIG)
    graph = trace(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, precision="bf16")
    facts = model_facts(graph, heads=8, vocab=4096)
    fixed = {"dp": 8, "tp": 1, "pp": 1, "microbatch": 8, "zero": 0, "recompute": "none"}
    roomy = search(graph, facts, H100, 64, fixed=fixed, use_ilp=False)
    peak = roomy.best.evaluation.peak_memory_bytes
    usable = planning_capacity_bytes(H100.gpu.memory_bytes, 0.0)
    assert peak <= usable * (1 - H100.memory_headroom)
    assert roomy.best.evaluation.headroom_bytes == pytest.approx(usable * H100.memory_headroom)
    # a GPU on which this plan uses 80% of the usable memory: it fits with 10% headroom, not with 30%
    gpu = H100.gpu.model_copy(update={"memory_bytes": int(peak / 0.8 + (H100.gpu.memory_bytes - usable))})
    for headroom, fits in ((0.1, True), (0.3, False)):
        cluster = H100.model_copy(update={"gpu": gpu, "memory_headroom": headroom})
        result = search(graph, facts, cluster, 64, fixed=fixed, use_ilp=False)
        assert (result.best is not None) == fits
        evaluation = result.ranked[0].evaluation
        assert evaluation.capacity_bytes == pytest.approx(planning_capacity_bytes(gpu.memory_bytes, headroom))
        report = evaluation_report(result.ranked[0])
        assert report.predicted.memory_headroom_bytes == pytest.approx(evaluation.headroom_bytes)


def test_a_cluster_file_sets_its_headroom(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("preset: dgx-h100\nmemory_headroom: 0.2\n")
    assert load_cluster(str(path)).memory_headroom == 0.2
    path.write_text("preset: dgx-h100\nmemory_headroom: 1.5\n")
    with pytest.raises(AutoparError, match="memory_headroom"):
        load_cluster(str(path))


# --- published runs' accountings ------------------------------------------------------------------
def test_published_accountings_follow_their_formulas():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from published_runs import published_run

    row = {"id": "x-1b", "layers": 24, "hidden": 2048, "heads": 16, "seq_len": 2048, "global_batch": 64,
           "tp": 1, "pp": 1, "dp": 8, "n_gpus": 8, "gpu": "A100-SXM4-80GB", "precision": "fp16 mixed",
           "measured_tflops_per_gpu": 100.0, "recompute": "full", "zero_stage": 0, "params_b": 1.3,
           "flops_accounting": "FLOPs = 96*B*s*l*h^2*(1+s/6h+V/16lh)", "notes": "vocab 51,200",
           "source": "a 2021 paper"}
    run = published_run(row)
    b, s, l, h, v = 64, 2048, 24, 2048, 51200
    assert run.vocab == v and run.family == "x" and run.fixed["attention"] == "math"
    hardware = 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
    assert run.measured_step_time_s() == pytest.approx(hardware / (100e12 * 8))
    model = published_run({**row, "flops_accounting": "MFU", "recompute": None, "source": "2024"})
    model.num_params = 1_000_000_000
    assert model.measured_step_time_s() == pytest.approx((6e9 + 12 * l * h * s) * b * s / (100e12 * 8))
    assert model.fixed["attention"] == "fused" and model.fixed["recompute"] == "none"
    # Megatron-LM's 2024 logged count: the logit GEMM once, no input-embedding term, no recompute
    logged = published_run({**row, "flops_accounting": "MFU", "recompute": None, "source": "2024",
                            "flops_formula": "megatron-lm-2024"})
    assert logged.measured_step_time_s() == pytest.approx(
        (72 * b * s * l * h**2 + 12 * b * s**2 * l * h + 6 * b * s * h * v) / (100e12 * 8))
    timed = published_run({**row, "iteration_time_s": 3.5})
    assert timed.measured_step_time_s() == 3.5
    assert isinstance(published_run({**row, "gpu": "V100"}), str)


def test_the_supplement_completes_rows_by_id_and_says_so(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from published_runs import load_runs, published_run

    runs = tmp_path / "runs.json"
    base = {"layers": 4, "hidden": 256, "heads": 4, "seq_len": 128, "global_batch": 64, "tp": 1, "pp": 2,
            "dp": 4, "n_gpus": 8, "gpu": "A100-SXM4-80GB", "measured_tflops_per_gpu": 100.0, "recompute": "full",
            "zero_stage": 0, "flops_accounting": "96*B*s*l*h^2", "notes": "vocab 1,024", "source": "2021"}
    runs.write_text(json.dumps({"runs": [{**base, "id": "a-1b"}, {**base, "id": "b-1b"}]}))
    supplement = tmp_path / "supplement.json"
    supplement.write_text(json.dumps({"overrides": [
        {"id": "a-1b", "micro_batch": 2, "vp": 1, "dp_overlap": True, "source": "a launch script"}]}))
    _, rows = load_runs(runs, supplement)
    a, b = (published_run(row) for row in rows)
    assert a.fixed["microbatch"] == 2 and a.fixed["schedule"] == "1f1b" and a.fixed["dp_overlap"] is True
    assert a.supplemented and "a launch script" in a.supplemented[0]
    assert "microbatch" not in b.fixed and b.fixed["dp_overlap"] is False and not b.supplemented
    # a row's own network replaces the preset's between nodes, nothing else
    own = published_run({**rows[1], "inter_node": {"bandwidth_bytes_per_s": 6.25e9, "efficiency": 1.0}})
    assert own.cluster.inter_node.effective_bandwidth_bytes_per_s == 6.25e9
    assert own.cluster.inter_node.latency_s == b.cluster.inter_node.latency_s
    assert own.cluster.intra_node == b.cluster.intra_node and any("network" in note for note in own.assumptions)


def test_the_runtime_refuses_a_plan_priced_for_other_software_before_anything_runs():
    """A plan saved from `--strategy attention=math` is a price, not something autopar runs."""
    import autopar
    from autopar.searcher.plan_builder import build_plan
    from autopar.searcher.search import search

    spec = build_model("gpt", "layers=2,hidden=64,heads=4,vocab=128,seq_len=32")
    graph = trace(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, precision="fp32")
    facts = model_facts(graph, heads=4, vocab=128)
    cluster = load_cluster("dgx-h100", gpus=1)
    result = search(graph, facts, cluster, 4, fixed={"attention": "math"}, use_ilp=False)
    plan = build_plan(result.best, graph, facts, cluster)
    assert plan.strategy.attention == "math"
    with pytest.raises(AutoparError, match="this plan cannot run: attention=math"):
        autopar.parallelize(spec.module, plan, loss_fn=spec.loss_fn)
