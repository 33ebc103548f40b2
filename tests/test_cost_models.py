"""Cost models: closed forms, textbook memory, schedules, monotonicity, and strategy rules."""

import pytest

from autopar.cluster import load_cluster
from autopar.errors import AutoparError
from autopar.graph import trace
from autopar.models import build_model
from autopar.plan_schema import Strategy
from autopar.cost_models.communication import collective_time_s, flat_collective_time_s, group_layout
from autopar.cost_models.evaluate import evaluate
from autopar.cost_models.memory import model_state_bytes
from autopar.cost_models.pipeline import estimate, simulate
from autopar.cost_models.strategy import check_strategy, parse_strategy

CLUSTER = load_cluster("dgx-a100-80gb", gpus=16)
LINK = CLUSTER.intra_node


@pytest.fixture(scope="module")
def facts(gpt_512):
    return gpt_512[1]


def strategy(**changes):
    fields = dict(dp=2, tp=2, pp=4, microbatch=1, num_microbatches=8, schedule="1f1b")
    fields.update(changes)
    return Strategy(**fields)


# --- communication ------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_all_reduce_closed_form(n):
    size = 1e9
    alpha, beta = LINK.latency_s, LINK.effective_bandwidth_bytes_per_s
    expected = 2 * (n - 1) / n * size / beta + 2 * (n - 1) * alpha
    assert flat_collective_time_s("all_reduce", size, n, LINK) == pytest.approx(expected)
    gather = flat_collective_time_s("all_gather", size, n, LINK)
    scatter = flat_collective_time_s("reduce_scatter", size, n, LINK)
    assert gather + scatter == pytest.approx(expected)  # all-reduce = reduce-scatter + all-gather


def test_group_layout_maps_axes_to_nodes():
    assert group_layout(8, 1, 8).nodes == 1  # tp=8 inside a node
    dp = group_layout(16, 8, 8)  # dp over nodes, one rank each
    assert (dp.ranks_per_node, dp.nodes) == (1, 16)
    mixed = group_layout(8, 2, 8)  # stride 2: 4 per node over 2 nodes
    assert (mixed.ranks_per_node, mixed.nodes) == (4, 2)


def test_crossing_nodes_is_slower_than_staying_inside():
    inside = collective_time_s("all_reduce", 1e9, group_layout(8, 1, 8), CLUSTER)
    across = collective_time_s("all_reduce", 1e9, group_layout(8, 8, 8), CLUSTER)
    assert across > 5 * inside


# --- memory -------------------------------------------------------------------------------------
@pytest.mark.parametrize("zero, microbatches, expected_per_param", [
    (0, 1, 2 + 2 + 12), (1, 1, 2 + (4 + 12) / 8), (1, 4, 2 + 4 + 12 / 8), (2, 4, 2 + (4 + 12) / 8),
    (3, 4, (2 + 4 + 12) / 8)])
def test_zero_memory_is_the_papers_with_fsdp2_fp32_gradients(zero, microbatches, expected_per_param):
    """Rajbhandari et al. 2020, Figure 1: (2+2+K)Ψ, 2Ψ+2Ψ+KΨ/Nd, 2Ψ+(2+K)Ψ/Nd, (2+2+K)Ψ/Nd with K=12,
    but the runtime's ZeRO is FSDP2 reducing in fp32: the gradient shards it keeps are 4 bytes, and
    ZeRO 1 accumulating micro-batches holds whole fp32 gradients (4 bytes) until its one reduction."""
    params = 7.5e9
    assert sum(model_state_bytes(params, "bf16", zero, 8, num_microbatches=microbatches)) == \
        pytest.approx(expected_per_param * params)


def test_more_tp_never_increases_parameter_bytes_and_recompute_never_increases_activations(facts):
    by_tp = [evaluate(facts, CLUSTER, strategy(dp=16 // (tp * 4), tp=tp, pp=4, num_microbatches=32 // (16 // (tp * 4))),
                      32).memory[0].parameters for tp in (1, 2, 4)]
    assert by_tp[0] > by_tp[1] > by_tp[2]
    activations = [evaluate(facts, CLUSTER, strategy(recompute=r), 16).memory[0].activations
                   for r in ("none", "selective", "full")]
    assert activations[0] >= activations[1] and activations[0] >= activations[2]
    assert activations[2] < activations[0] / 1.5


# --- pipeline -----------------------------------------------------------------------------------
@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (8, 8), (4, 32)])
def test_1f1b_bubble_fraction(pp, m):
    result = simulate([1.0] * pp, [2.0] * pp, m, "1f1b", pp=pp)
    bubble_fraction = (result.step_time_s - m * 3.0) / result.step_time_s
    assert bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
    assert result.peak_in_flight == tuple(min(pp - r, m) for r in range(pp))


@pytest.mark.parametrize("vp", [2, 4])
def test_interleaving_shrinks_the_bubble_by_v(vp):
    pp, m = 4, 8
    plain = simulate([1.0] * pp, [2.0] * pp, m, "1f1b", pp=pp)
    interleaved = simulate([1.0 / vp] * (pp * vp), [2.0 / vp] * (pp * vp), m, "interleaved", pp=pp, vp=vp)
    assert interleaved.bubble_s == pytest.approx(plain.bubble_s / vp)


@pytest.mark.parametrize("schedule, vp", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_closed_form_matches_simulation_on_uniform_stages(schedule, vp):
    pp, m = 4, 16
    args = ([0.5] * (pp * vp), [1.0] * (pp * vp), m, schedule)
    exact, quick = simulate(*args, pp=pp, vp=vp), estimate(*args, pp=pp, vp=vp)
    assert quick.step_time_s == pytest.approx(exact.step_time_s)
    assert quick.peak_in_flight == pytest.approx(exact.peak_in_flight)


def test_gpipe_holds_every_microbatch():
    result = simulate([1.0] * 2, [1.0] * 2, 6, "gpipe", pp=2)
    assert result.peak_in_flight == (6.0, 6.0)


# --- the evaluator -------------------------------------------------------------------------------
def test_evaluation_is_consistent(facts):
    result = evaluate(facts, CLUSTER, strategy(recompute="full"), 16)
    assert result.fits
    assert result.tokens_per_s == pytest.approx(16 * 256 / result.step_time_s)
    assert 0 < result.mfu < 1
    parts = result.breakdown
    assert parts["recompute"] > 0 and parts["bubble"] > 0
    assert sum(parts.values()) == pytest.approx(result.step_time_s, rel=0.05)


def test_each_pipeline_rank_computes_its_own_stages(facts):
    result = evaluate(facts, CLUSTER, strategy(recompute="full"), 16)
    assert len(result.rank_compute_s) == 4
    # the critical rank's compute figure is the breakdown's compute + recompute + optimizer
    parts = result.breakdown
    assert max(result.rank_compute_s) >= parts["compute"] + parts["recompute"] + parts["optimizer"] - 1e-12
    # the first rank holds the embedding, the last the head: unlike the middle ranks, which match
    first, second, third, last = result.rank_compute_s
    assert second == pytest.approx(third) and first != pytest.approx(second) and last > second
    # one rank: exactly the breakdown's compute parts, none of its communication
    single = evaluate(facts, CLUSTER, strategy(pp=1, recompute="selective"), 16)
    parts = single.breakdown
    assert parts["exposed_communication"] > 0
    assert single.rank_compute_s == pytest.approx((parts["compute"] + parts["recompute"] + parts["optimizer"],))


def test_tensor_parallel_all_reduces_per_layer(facts):
    from autopar.cost_models.compute import unit_time

    layer = facts.units[facts.layer_units[0]]
    timing = unit_time(layer, CLUSTER.gpu, "bf16", batch=1, tp=2, sp=False)
    # Megatron-LM: two all-reduces of the (b, s, h) activation in forward, two in backward.
    assert (timing.forward_reduces, timing.backward_reduces) == (2, 2)
    assert timing.forward_reduce_bytes == pytest.approx(2 * 256 * 512 * 2)


# --- strategy rules -----------------------------------------------------------------------------
def test_parse_strategy():
    assert parse_strategy("tp=8,pp=12,dp=16,microbatch=1,zero=1,recompute=full,schedule=1f1b,vp=1,sp=true") == {
        "tp": 8, "pp": 12, "dp": 16, "microbatch": 1, "zero": 1, "recompute": "full", "schedule": "1f1b", "vp": 1,
        "sp": True,
    }
    for bad, words in [("tp", "key=value"), ("foo=1", "key=value"), ("zero=5", "0 to 3"), ("tp=x", "whole number"),
                       ("cp_kind=zigzag", "ring, ulysses"), ("recompute=some", "none, selective, full"),
                       ("tp=2,tp=4", "twice")]:
        with pytest.raises(AutoparError, match=words):
            parse_strategy(bad)


@pytest.mark.parametrize(
    "changes, batch, words",
    [
        (dict(tp=3, dp=1, pp=1), 8, "dp×cp×tp×pp"),
        (dict(dp=1, tp=16, pp=1, num_microbatches=8), 8, "does not divide the 8 attention heads"),
        (dict(dp=1, tp=1, pp=16, num_microbatches=16), 16, "stages for 8 layers"),
        (dict(num_microbatches=3), 6, "at least pp=4 micro-batches"),
        (dict(microbatch=3, num_microbatches=2), 16, "not divisible by dp×microbatch"),
    ],
)
def test_invalid_strategies_name_the_rule(changes, batch, words):
    with pytest.raises(AutoparError, match=words):
        check_strategy(strategy(**changes), world_size=16, global_batch=batch, layers=8, heads=8)


# --- calibration from profiles --------------------------------------------------------------------
def test_calibration_recovers_known_efficiencies():
    from autopar.cluster import GpuSpec
    from autopar.cost_models.calibration import _gemm_shape_factor, calibrate
    from autopar.cost_models.compute import Efficiency

    spec = build_model("gpt", "layers=2,hidden=256,heads=4,vocab=512,seq_len=128")
    graph = trace(spec.module, spec.example_inputs(2), loss_fn=spec.loss_fn, precision="bf16")
    gpu = GpuSpec(name="test", peak_tflops={"bf16": 100.0}, memory_bytes=2**34, hbm_bandwidth_bytes_per_s=1e12)
    times = {}
    # the shape term is off by default; calibrating a base that has one divides its factors out
    shaped = Efficiency(gemm_half_ridges=1.71)
    # a synthetic device: GEMMs at a 50% ceiling lowered by their shapes as the predictions' shape law
    # says (so the ceiling, not each GEMM's own efficiency, is what calibration recovers), attention
    # at 40%, HBM at 70% beside the base's time per kernel, 7 µs per tiny op
    for node in graph.nodes:
        moved = node.bytes_read + node.bytes_written
        if node.is_view:
            continue
        if "flash_attention" in node.op:
            times[node.name] = node.flops / (0.4 * 100e12)
        elif node.flops:
            times[node.name] = node.flops / (0.5 * _gemm_shape_factor(node, gpu, "bf16", shaped) * 100e12)
        elif moved >= 2**20:
            times[node.name] = moved / (0.7 * 1e12) + shaped.launch_overhead_s
        elif moved < 2**16:
            times[node.name] = 7e-6
    result = calibrate(graph, times, gpu, "test", base=shaped)
    factors = {round(_gemm_shape_factor(n, gpu, "bf16", shaped), 6) for n in graph.nodes if n.flops}
    assert len(factors - {1.0}) > 1  # GEMM shapes differ, so dividing their factors out is what is checked
    assert result.efficiency.matmul == pytest.approx(0.5)
    assert result.efficiency.attention == pytest.approx(0.4)
    assert result.efficiency.memory == pytest.approx(0.7)
    assert all(result.samples[k] > 0 for k in ("matmul", "attention", "memory"))


def test_calibrated_memory_efficiency_leaves_each_op_s_floor_to_the_per_kernel_time():
    """Ops timed alone pay a fixed floor beside their bytes: the calibrated bandwidth is the one at
    which the ops, priced as a step prices them (bytes over it plus the per-kernel time), sum to what
    they took. A median of bytes over time would charge the floor to every byte (here 0.04, not 0.7)."""
    from autopar.cost_models.calibration import calibrate
    from autopar.cost_models.compute import DEFAULT_EFFICIENCY

    spec = build_model("gpt", "layers=2,hidden=256,heads=4,vocab=512,seq_len=128")
    graph = trace(spec.module, spec.example_inputs(2), loss_fn=spec.loss_fn, precision="bf16")
    bandwidth = CLUSTER.gpu.hbm_bandwidth_bytes_per_s
    floor_s = DEFAULT_EFFICIENCY.launch_overhead_s
    moving = [n for n in graph.nodes if not n.is_view and not n.flops and n.bytes_read + n.bytes_written >= 2**20]
    assert len(moving) >= 2
    times = {n.name: floor_s + (n.bytes_read + n.bytes_written) / (0.7 * bandwidth) for n in moving}
    result = calibrate(graph, times, CLUSTER.gpu, "test")
    assert result.efficiency.memory == pytest.approx(0.7)
    assert result.samples["memory"] == len(moving)
    # ops no slower than the per-kernel time: the bandwidth's limit as their bytes' share shrinks, the cap
    for share in (0.5, 1.0):
        quick = {n.name: floor_s * share for n in moving}
        assert calibrate(graph, quick, CLUSTER.gpu, "test").efficiency.memory == 1.0
    barely = {n.name: floor_s * 1.001 for n in moving}
    assert calibrate(graph, barely, CLUSTER.gpu, "test").efficiency.memory == 1.0


def test_launch_overhead_is_measured_from_enough_tiny_ops_only():
    """A profile times each op alone: a few tiny ops measure the timer, so fewer than
    MIN_LAUNCH_SAMPLES leave the documented default."""
    from autopar.cost_models.calibration import MIN_LAUNCH_SAMPLES, calibrate
    from autopar.cost_models.compute import DEFAULT_EFFICIENCY

    spec = build_model("gpt", "layers=2,hidden=32,heads=4,vocab=64,seq_len=8")
    graph = trace(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, precision="bf16")
    tiny = [n.name for n in graph.nodes if not n.is_view and not n.flops and n.bytes_read + n.bytes_written < 2**16]
    assert len(tiny) >= MIN_LAUNCH_SAMPLES
    enough = calibrate(graph, {name: 7e-6 for name in tiny}, CLUSTER.gpu, "test")
    assert enough.efficiency.launch_overhead_s == pytest.approx(7e-6)
    assert enough.samples["launch_overhead_s"] == len(tiny)
    few = calibrate(graph, {name: 7e-6 for name in tiny[:MIN_LAUNCH_SAMPLES - 1]}, CLUSTER.gpu, "test")
    assert few.efficiency.launch_overhead_s == DEFAULT_EFFICIENCY.launch_overhead_s


def test_the_profiles_batch_is_read_off_its_signatures():
    """A profile recorded at batch 8 and sequence 2048 of a hidden-2048 model: weights [2048,2048]
    and a [8,16,2048,2048] score tensor must not be taken for the batch."""
    from autopar.cost_models.calibration import profiled_batch

    keys = ["aten.mm.default(bfloat16[16384,2048],bfloat16[2048,2048])->(bfloat16[16384,2048]){}",
            "aten.add.Tensor(bfloat16[8,2048,2048],bfloat16[8,2048,2048])->(bfloat16[8,2048,2048]){}",
            "aten.gelu.default(bfloat16[8,2048,8192])->(bfloat16[8,2048,8192]){}",
            "aten.softmax(bfloat16[8,16,2048,2048])->(bfloat16[8,16,2048,2048]){}",
            "aten.arange.default()->(int64[2048]){dtype='int64',end=2048}"]
    assert profiled_batch(keys, 2048) == 8
    assert profiled_batch(keys, 1024) is None and profiled_batch(keys, None) is None


def test_calibration_without_samples_keeps_the_documented_defaults():
    from autopar.cost_models.calibration import calibrate
    from autopar.cost_models.compute import DEFAULT_EFFICIENCY

    spec = build_model("gpt", "layers=1,hidden=64,heads=4,vocab=100,seq_len=16")
    graph = trace(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, precision="bf16")
    result = calibrate(graph, {}, CLUSTER.gpu, "nowhere")
    assert result.efficiency == DEFAULT_EFFICIENCY
    assert set(result.samples.values()) == {0}


# --- the collective ledger of per-parameter placements (the intra-op ILP's plans) -----------------
@pytest.fixture(scope="module")
def tiny_gpt(tiny_gpt_fp32):
    return tiny_gpt_fp32


def _placed_ledger(graph, facts, placements, s, rank=0):
    from autopar.cost_models.collectives import step_collectives
    from autopar.cost_models.placed_collectives import placed_units
    from autopar.cost_models.evaluate import partition

    placed = placed_units(graph, facts.units, placements, s.microbatch)
    stages = [[placed.units[u.name] for u in units] for units in partition(facts, s.pp * s.vp)]
    return step_collectives(stages, s, facts.precision, rank, seq_len=facts.seq_len,
                            vocab=facts.vocab if placed.vocab_parallel_head else None,
                            recompute_repeats=placed.recompute_repeats)


@pytest.mark.parametrize("changes", [dict(pp=1, dp=1), dict(pp=1, zero=3), dict(pp=1, zero=1, recompute="full"),
                                     dict(dp=1, recompute="full"), dict(vp=2, schedule="interleaved")])
def test_placed_ledger_of_the_megatron_layout_is_the_propagations(tiny_gpt, changes):
    """Module by module from placements, the Megatron layout sends what the graph propagation (checked
    against the runtime by the parity tests) predicts, on every pipeline rank."""
    _placed_megatron_is_propagated(*tiny_gpt, changes)


@pytest.mark.parametrize("changes", [dict(pp=2, dp=1), dict(pp=2, zero=1, recompute="full")])
def test_llama_block_reductions_stay_in_their_layer(tiny_llama, changes):
    """RMSNorm's backward is linear: the graph propagation once carried each attention block's input
    all-reduce through it into the previous layer (a pipeline rank off, as a parity run measured).
    The runtime sums it on entry to the block; every layer now holds its own two per direction."""
    graph, facts = tiny_llama
    _placed_megatron_is_propagated(graph, facts, changes)
    module = {node.name: node.module_path for node in graph.nodes}
    for unit in facts.units:
        summed = [module[op.name] for op in unit.backward_ops if op.reduce_bytes]
        if unit.layer_type is None:
            assert unit.name == "post" or not summed, (unit.name, summed)  # the embedding gets a whole gradient
            continue
        assert len(summed) == 2, (unit.name, summed)
        for path in summed:  # on entry to the block: in this layer's norm, which holds no shard
            assert path.startswith(unit.name + ".") and not any(p.startswith(path + ".") for p in facts.param_tp_dims)


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_fp32):
    return tiny_llama_fp32


def _placed_megatron_is_propagated(graph, facts, changes):
    from autopar.cost_models.collectives import step_collectives
    from autopar.cost_models.evaluate import partition

    s = strategy(**{"pp": 2, "microbatch": 2, "num_microbatches": 4, **changes})
    megatron = {name: f"S({dim})" for name, dim in facts.param_tp_dims.items()}
    megatron.update({p.name: "S(0)" for p in graph.params
                     if p.name.endswith(".bias") and megatron.get(p.name.removesuffix(".bias") + ".weight") == "S(0)"})
    stages = partition(facts, s.pp * s.vp)
    for rank in range(s.pp):
        propagated = step_collectives(stages, s, facts.precision, rank, seq_len=facts.seq_len, vocab=facts.vocab)
        assert _placed_ledger(graph, facts, megatron, s, rank) == propagated
        assert any(axis == "tp" for axis, _ in propagated)


def test_placed_ledger_follows_each_layer_placement(tiny_gpt):
    graph, facts = tiny_gpt
    layers, hidden = 4, 32
    s = strategy(dp=2, pp=1, microbatch=2, num_microbatches=2)
    activation = s.microbatch * facts.seq_len * hidden * 4  # fp32 (b, s, h)
    numel = {p.name: p.numel for p in graph.params}

    def blocks(name, columns, row):
        out = {}
        for i in range(layers):
            out.update({f"layers.{i}.{name}.{c}.{kind}": "S(0)" for c in columns for kind in ("weight", "bias")})
            out[f"layers.{i}.{name}.{row}.weight"] = "S(1)"
        return out

    replicated = _placed_ledger(graph, facts, {}, s)
    assert not [key for key in replicated if key[0] == "tp"]
    assert replicated[("dp", "all_reduce")] == (1, sum(numel.values()) * 4)

    attention = blocks("attn", ("q_proj", "k_proj", "v_proj"), "out_proj")
    sent = _placed_ledger(graph, facts, attention, s)
    # forward: the row projection's output; backward: the block input's gradient; nothing else
    assert sent[("tp", "all_reduce")] == (s.num_microbatches * 2 * layers, s.num_microbatches * 2 * layers * activation)
    local = sum(numel.values()) - sum(numel[name] for name in attention) / s.tp
    assert sent[("dp", "all_reduce")] == (1, local * 4)
    # a replicated MLP after a sharded attention saves activations: full recompute resends its all-reduce
    resent = _placed_ledger(graph, facts, attention, s.model_copy(update={"recompute": "full"}))
    assert resent[("tp", "all_reduce")][0] == s.num_microbatches * 3 * layers
    # a sharded MLP is the layer's last collective: recomputation stops before it
    mlp = blocks("mlp", ("fc1",), "fc2")
    assert (_placed_ledger(graph, facts, mlp, s.model_copy(update={"recompute": "full"}))[("tp", "all_reduce")]
            == _placed_ledger(graph, facts, mlp, s)[("tp", "all_reduce")])
    # a vocabulary-parallel embedding and head (tied): lookup all-reduce, head input gradient, loss reductions
    vocab = _placed_ledger(graph, facts, {"embed.weight": "S(0)"}, s)
    loss = s.microbatch * (facts.seq_len - 1) * 4
    assert vocab[("tp", "all_reduce")] == (s.num_microbatches * 5, s.num_microbatches * (2 * activation + 3 * loss))
    # a hidden-sharded position table: one all-gather of the (s, h) table per micro-batch, whatever the batch
    gathered = _placed_ledger(graph, facts, {"pos_embed.weight": "S(1)"}, s)
    assert gathered[("tp", "all_gather")] == (s.num_microbatches, s.num_microbatches * facts.seq_len * hidden * 4)


def test_what_if_charges_the_vocabulary_parallel_head_under_tp(facts):
    from autopar.searcher.candidates import what_if

    fixed = dict(dp=2, tp=2, pp=4, microbatch=1, zero=0, recompute="none", sp=False, schedule="1f1b", vp=1)
    result = what_if(facts, CLUSTER, fixed, 16, layers=8, top_k=1)
    (chosen,) = result.ranked
    with_head = evaluate(facts, CLUSTER, chosen.strategy, 16, vocab=facts.vocab)
    without_head = evaluate(facts, CLUSTER, chosen.strategy, 16)
    assert chosen.step_time_s == pytest.approx(with_head.step_time_s)
    assert with_head.step_time_s > without_head.step_time_s  # the head's collectives cost something


def test_tied_embedding_gradient_sum_over_the_pipeline_is_charged(facts):
    from autopar.cost_models.collectives import GRADIENT_REDUCE_BYTES, tied_across_ranks
    from autopar.cost_models.evaluate import partition

    s = strategy(dp=1, tp=1, pp=2, num_microbatches=16)
    result = evaluate(facts, CLUSTER, s, 16)
    summed = tied_across_ranks(partition(facts, 2), 2, 1)
    assert summed[0]["summed"] > 0 and summed[1]["summed"] > 0  # the embedding (rank 0) and the head (rank 1)
    layout = group_layout(2, 1, CLUSTER.gpus_per_node)
    expected = collective_time_s("all_reduce", summed[0]["summed"] * GRADIENT_REDUCE_BYTES, layout, CLUSTER)
    # nothing else to expose with dp = tp = 1: the breakdown's communication is that one sum
    assert result.breakdown["exposed_communication"] == pytest.approx(expected)


def test_unoverlapped_gradient_sync_exposes_the_whole_reduction(facts):
    s = strategy(dp=4, tp=2, pp=2, num_microbatches=4)
    overlapped = evaluate(facts, CLUSTER, s, 16)
    after_backward = evaluate(facts, CLUSTER, s, 16, overlap_grad_sync=False)
    assert after_backward.step_time_s > overlapped.step_time_s
    assert after_backward.breakdown["exposed_communication"] > overlapped.breakdown["exposed_communication"]
    assert after_backward.breakdown["compute"] == pytest.approx(overlapped.breakdown["compute"])
