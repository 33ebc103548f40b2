"""Issue #29's compute terms in closed form: the optimizer step per implementation, misaligned
16-bit GEMMs, and torch.compile's fused elementwise kernels (whole stage, or the blocks only)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.capabilities import whole_stage_problem
from autopar.cluster import load_cluster
from autopar.cost_models.compute import (COMPILE_FUSED_FRACTION, DEFAULT_EFFICIENCY, MISALIGNED_GEMM_FACTOR,
                                         op_time_s, padding_copy_bytes, unit_time)
from autopar.cost_models.evaluate import evaluate
from autopar.cost_models.optimizer import step_bytes_per_param
from autopar.graph import trace
from autopar.models import build_model
from autopar.cost_models.facts import model_facts
from autopar.plan_schema import Strategy

H100 = load_cluster("dgx-h100", gpus=2)
CONFIG = "layers=2,hidden=256,heads=4,seq_len=256,vocab={vocab}"


def facts_for(vocab: int, multiple: int = 128, precision: str = "bf16"):
    spec = build_model("gpt", CONFIG.format(vocab=vocab) + f",vocab_multiple={multiple}")
    graph = trace(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, precision=precision)
    return model_facts(graph, heads=4, vocab=spec.config.padded_vocab)


@pytest.fixture(scope="module")
def padded():
    return facts_for(1000)


def test_optimizer_step_bytes_are_torchs_passes():
    assert step_bytes_per_param("fused", clip=False) == 28  # read w, g, m, v; write w, m, v
    assert step_bytes_per_param("foreach", clip=False) == 84  # eight foreach passes
    assert step_bytes_per_param("fused") == 28 + 4  # clipping: a norm read; the fused step applies the scale
    assert step_bytes_per_param("foreach") == 84 + 12  # and before a foreach step, a scaling read and write
    assert step_bytes_per_param("apex") == 28 + 12  # a fused kernel, the clip's scaling a pass of its own
    assert step_bytes_per_param("fused", "bf16", clip=False) == 20
    assert step_bytes_per_param("foreach", "bf16", clip=False) == 84 - 16


def test_the_optimizer_time_is_its_bytes_over_the_hbm(padded):
    s = Strategy(dp=1, tp=1, pp=1, microbatch=2, num_microbatches=1)
    cluster = load_cluster("dgx-h100", gpus=1)
    fused = evaluate(padded, cluster, s, 2).breakdown["optimizer"]
    foreach = evaluate(padded, cluster, s.model_copy(update={"optimizer_impl": "foreach"}), 2).breakdown["optimizer"]
    bandwidth = cluster.gpu.hbm_bandwidth_bytes_per_s * DEFAULT_EFFICIENCY.memory
    assert fused == pytest.approx(padded.num_params * 32 / bandwidth, rel=1e-6)
    assert foreach - fused == pytest.approx(padded.num_params * 64 / bandwidth, rel=1e-6)


def test_a_misaligned_16_bit_gemm_runs_at_the_fallback_fraction():
    aligned, misaligned = facts_for(1001), facts_for(1001, multiple=1)  # head width 1024 vs 1001

    def head_forward(facts):
        post = next(u for u in facts.units if u.name == "post")
        return next(op for op in post.forward_ops if op.kind == "matmul")

    op_a, op_m = head_forward(aligned), head_forward(misaligned)
    gpu = H100.gpu
    time_a = op_time_s(op_a, gpu, "bf16", batch=64, tp=1, sp=False)
    time_m = op_time_s(op_m, gpu, "bf16", batch=64, tp=1, sp=False)
    overhead = DEFAULT_EFFICIENCY.launch_overhead_s
    peak, ceiling = gpu.peak_flops_per_s("bf16"), DEFAULT_EFFICIENCY.matmul_for(gpu)
    bandwidth = gpu.hbm_bandwidth_bytes_per_s * DEFAULT_EFFICIENCY.memory

    def roofline_s(op, efficiency):
        return max(op.flops * 64 / (peak * efficiency), (op.activation_bytes * 64 + op.weight_bytes) / bandwidth)

    # the aligned head at the GEMM efficiency; the misaligned one at the fallback fraction of it
    assert time_a - overhead == pytest.approx(roofline_s(op_a, ceiling), rel=1e-9)
    assert time_m - overhead == pytest.approx(roofline_s(op_m, ceiling * MISALIGNED_GEMM_FACTOR), rel=1e-9)
    assert time_m > 2.5 * time_a
    assert op_time_s(op_m, gpu, "fp32", batch=64, tp=1, sp=False) <= op_time_s(op_a, gpu, "fp32", batch=64, tp=1,
                                                                               sp=False)  # no penalty off 16 bits
    # compiled, inductor pads the operands (shape_padding): the aligned efficiency on the padded width,
    # after its pad copies where the layer is one the runtime could pad
    compiled = dataclasses.replace(DEFAULT_EFFICIENCY, compiled=True)
    time_c = op_time_s(op_m, gpu, "bf16", batch=64, tp=1, sp=False, efficiency=compiled)
    dims = op_m.gemm.at(64, 1)
    copies = padding_copy_bytes(op_m, dims) / bandwidth if op_m.gemm.padding else 0.0
    assert time_c - overhead == pytest.approx(roofline_s(op_m, ceiling) + copies, rel=1e-9)


def test_compiled_vector_ops_move_the_unfused_share_of_their_bytes(padded):
    vector = next(op for u in padded.units for op in u.forward_ops if op.kind == "vector" and op.activation_bytes)
    gpu = H100.gpu
    eager = op_time_s(vector, gpu, "bf16", batch=4, tp=1, sp=False)
    compiled = op_time_s(vector, gpu, "bf16", batch=4, tp=1, sp=False,
                         efficiency=dataclasses.replace(DEFAULT_EFFICIENCY, compiled=True))
    # the fused share is gone as kernels: its bytes and its launches
    assert compiled == pytest.approx(eager * (1 - COMPILE_FUSED_FRACTION), rel=1e-9)


def test_compile_fuses_the_whole_stage_or_only_the_blocks(padded):
    one = Strategy(dp=1, tp=1, pp=1, microbatch=2, num_microbatches=1)
    cluster = load_cluster("dgx-h100", gpus=1)
    eager = evaluate(padded, cluster, one, 2).breakdown["compute"]
    whole = evaluate(padded, cluster, one.model_copy(update={"compile": True}), 2).breakdown["compute"]
    assert whole_stage_problem(one) is None and whole < eager
    zero3 = Strategy(dp=2, tp=1, pp=1, zero=3, microbatch=1, num_microbatches=1)
    assert whole_stage_problem(zero3) == "FSDP2 units (zero >= 1)"
    eager3 = evaluate(padded, H100, zero3, 2).breakdown["compute"]
    blocks = evaluate(padded, H100, zero3.model_copy(update={"compile": True}), 2).breakdown["compute"]
    # per block: the layers' vector ops fused, the embedding's, head's and loss's not
    layer_vector = sum(op_time_s(op, H100.gpu, "bf16", batch=1, tp=1, sp=False)
                       for u in padded.units if u.layer_type is not None for op in u.forward_ops + u.backward_ops
                       if op.kind == "vector")
    assert eager3 - blocks == pytest.approx(layer_vector * COMPILE_FUSED_FRACTION, rel=1e-6)


def test_per_micro_batch_weight_passes_are_their_bytes_over_the_hbm(padded):
    """Autocast over fp32 weights casts each weight forward (6 B per parameter) and its gradient back
    (6 B) every micro-batch; micro-batches after the first add their gradients into .grad (12 B);
    a recomputed layer (full or selective) casts again. `weight_passes=false` (Megatron-LM) moves none of it."""
    cluster = load_cluster("dgx-h100", gpus=1)
    bandwidth = cluster.gpu.hbm_bandwidth_bytes_per_s * DEFAULT_EFFICIENCY.memory
    params = padded.num_params

    def compute_s(**fields):
        s = Strategy(dp=1, tp=1, pp=1, microbatch=1, **fields)
        return evaluate(padded, cluster, s, s.num_microbatches).breakdown

    def without(**fields):
        return compute_s(weight_passes=False, **fields)

    # 16-bit weights also leave autocast's activation bytes (`cost_models.autocast`) out: per
    # micro-batch, each unit's passes under autocast less the same passes without it
    on, off = (dataclasses.replace(DEFAULT_EFFICIENCY, autocast=flag) for flag in (True, False))
    times = [(unit_time(u, cluster.gpu, "bf16", batch=1, tp=1, sp=False, efficiency=on),
              unit_time(u, cluster.gpu, "bf16", batch=1, tp=1, sp=False, efficiency=off), u.layer_type is not None)
             for u in padded.units]
    activations = sum(a.forward_s + a.backward_s - b.forward_s - b.backward_s for a, b, _ in times)
    assert activations > 0
    recomputed = {"full": sum(a.forward_s - b.forward_s for a, b, layer in times if layer),
                  "selective": sum(a.forward_vector_s - b.forward_vector_s for a, b, layer in times if layer)}

    one, one_off = compute_s(num_microbatches=1), without(num_microbatches=1)
    assert one["compute"] - one_off["compute"] == pytest.approx(params * 12 / bandwidth + activations, rel=1e-6)
    four, four_off = compute_s(num_microbatches=4), without(num_microbatches=4)
    assert four["compute"] - four_off["compute"] == pytest.approx(
        params * (4 * 12 + 3 * 12) / bandwidth + 4 * activations, rel=1e-6)
    full, full_off = compute_s(num_microbatches=1, recompute="full"), without(num_microbatches=1, recompute="full")
    layers = sum(u.params for u in padded.units if u.layer_type is not None)
    step = full["compute"] + full["recompute"] - full_off["compute"] - full_off["recompute"]
    assert step == pytest.approx((params * 12 + layers * 6) / bandwidth + activations + recomputed["full"], rel=1e-6)
    # selective recompute saves the GEMMs' outputs, not the casts: its recompute casts again too
    selective = compute_s(num_microbatches=1, recompute="selective")
    selective_off = without(num_microbatches=1, recompute="selective")
    step = selective["compute"] + selective["recompute"] - selective_off["compute"] - selective_off["recompute"]
    assert step == pytest.approx((params * 12 + layers * 6) / bandwidth + activations + recomputed["selective"],
                                 rel=1e-6)
    zero3 = compute_s(num_microbatches=4, zero=3)  # bf16 shards gathered by FSDP2: no autocast casts
    zero3_off = without(num_microbatches=4, zero=3)
    assert zero3["compute"] - zero3_off["compute"] == pytest.approx(params * 3 * 12 / bandwidth, rel=1e-6)


def test_a_stage_compiled_whole_keeps_min_cuts_activations_and_one_16_bit_logits_gradient(padded):
    """Compiled whole without recompute (`cost_models.compiled_stage`): the activations at min-cut's
    ratio, the loss's fp32 log-probabilities saved as bf16 logits, and one bf16 gradient of the logits
    in place of eager's two fp32; with recompute, eager's terms; in fp32, min-cut's fp32 ratio."""
    from autopar.cost_models.compiled_stage import COMPILED_ACTIVATION_FACTOR, COMPILED_FP32_ACTIVATION_FACTOR
    from autopar.cost_models.memory import (AUTOCAST_ACTIVATION_FACTOR, UNSHARDED_ALLOCATOR_SLACK,
                                            activation_scale)

    one = Strategy(dp=1, tp=1, pp=1, microbatch=2, num_microbatches=1)
    cluster = load_cluster("dgx-h100", gpus=1)
    eager = evaluate(padded, cluster, one, 2).memory[0]  # activations counted at autocast's dtypes
    compiled = evaluate(padded, cluster, one.model_copy(update={"compile": True}), 2).memory[0]
    uncounted = dataclasses.replace(padded, autocast_activation_factor=None)  # at the traced bytes
    eager_traced = evaluate(uncounted, cluster, one, 2).memory[0]
    logits = 2 * padded.seq_len * padded.vocab
    assert eager.buffers == pytest.approx(8 * logits) and compiled.buffers == pytest.approx(2 * logits)
    assert eager_traced.activations - compiled.activations == pytest.approx((4 - 2) * logits)
    assert eager.activations > 1.1 * eager_traced.activations  # the fp32 residual and per-projection casts
    assert activation_scale("bf16", 0, "none", "fp32", compiled=True) == pytest.approx(
        COMPILED_ACTIVATION_FACTOR * (1 + UNSHARDED_ALLOCATOR_SLACK))
    for memory, factor in ((eager, 1.0), (eager_traced, AUTOCAST_ACTIVATION_FACTOR),
                           (compiled, COMPILED_ACTIVATION_FACTOR)):
        assert memory.margin == pytest.approx(
            (factor * (1 + UNSHARDED_ALLOCATOR_SLACK) - 1) * memory.activations
            + UNSHARDED_ALLOCATOR_SLACK * (memory.buffers + memory.parameters + memory.gradients
                                           + memory.optimizer_states))
    # with recompute (not measured) the layers and the loss keep eager's terms
    recompute = one.model_copy(update={"compile": True, "recompute": "full"})
    recomputed = evaluate(padded, cluster, recompute, 2)
    assert recomputed.activation_scale == pytest.approx(activation_scale("bf16", 0, "none", "fp32",
                                                                         autocast_counted=True))
    assert recomputed.memory == evaluate(padded, cluster, one.model_copy(update={"recompute": "full"}), 2).memory
    # fp32: min-cut's fp32 ratio for the layers, eager's loss (measured under bf16 autocast only)
    fp32 = facts_for(1000, precision="fp32")
    eager32 = evaluate(fp32, cluster, one, 2)
    compiled32 = evaluate(fp32, cluster, one.model_copy(update={"compile": True}), 2)
    assert compiled32.memory[0].buffers == eager32.memory[0].buffers == pytest.approx(8 * logits)
    assert compiled32.memory[0].activations == eager32.memory[0].activations
    assert compiled32.activation_scale == pytest.approx(
        COMPILED_FP32_ACTIVATION_FACTOR * (1 + UNSHARDED_ALLOCATOR_SLACK))
    assert eager32.activation_scale == pytest.approx(1 + UNSHARDED_ALLOCATOR_SLACK)
    # per-block compile (FSDP2 units): the loss stays eager
    zero3 = Strategy(dp=2, tp=1, pp=1, zero=3, microbatch=1, num_microbatches=1, compile=True)
    assert evaluate(padded, H100, zero3, 2).memory[0].buffers >= 8 * padded.seq_len * padded.vocab


def test_the_compiled_activation_model_covers_what_min_cut_saves(monkeypatch):
    """benchmarks/compiled_memory.py on GPT-1.3B's widths (fake tensors, CPU): a layer keeps at most
    COMPILED_ACTIVATION_FACTOR of its traced bytes, and the cost model's compiled activations for the
    whole model cover what min-cut saves, within 5% above."""
    import sys
    from pathlib import Path

    from autopar.cost_models.compiled_stage import COMPILED_ACTIVATION_FACTOR

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    sys.modules.pop("compiled_memory", None)
    import compiled_memory

    batch, seq_len, layers = 2, 1024, 24
    measured = compiled_memory.measure("gpt3-1.3b", None, batch, seq_len)
    traced, cut = measured["traced"], measured["min-cut"]
    assert cut["layer"] <= COMPILED_ACTIVATION_FACTOR * traced["layer"]
    assert cut["layer"] < measured["default"]["layer"]  # min-cut recomputes what the default saves
    saved = layers * cut["layer"] + cut["rest"]
    spec = build_model("gpt3-1.3b", f"seq_len={seq_len}")
    graph = trace(spec.module, spec.example_inputs(1, seq_len), loss_fn=spec.loss_fn, precision="bf16",
                  seq_len=seq_len)
    facts = model_facts(graph, heads=16, vocab=spec.config.padded_vocab)
    plan = Strategy(dp=1, tp=1, pp=1, microbatch=batch, num_microbatches=1, compile=True)
    modelled = evaluate(facts, load_cluster("dgx-h100", gpus=1), plan, batch).memory[0].activations
    assert saved <= COMPILED_ACTIVATION_FACTOR * modelled <= 1.05 * saved


class WeightCasts(TorchDispatchMode):
    """Counts the casts (`aten._to_copy`) of the given weights while it is active."""

    def __init__(self, weights):
        super().__init__()
        self.weights, self.count = weights, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and any(args[0] is w for w in self.weights):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_the_runtimes_recompute_casts_the_weights_again_under_autocast(policy):
    """What the weight-pass term above prices: under autocast over fp32 weights, the runtime's
    recompute (`runtime.recompute`) casts each weight of the layer to 16 bits again in backward."""
    from autopar.runtime.recompute import apply_recompute

    def backward_casts(recompute: str) -> int:
        torch.manual_seed(0)
        layer = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 64), torch.nn.GELU(),
                                    torch.nn.Linear(64, 32))
        apply_recompute(torch.nn.ModuleDict({"layer": layer}), ["layer"], recompute)
        with torch.autocast("cpu", torch.bfloat16):
            loss = layer(torch.randn(2, 8, 32, requires_grad=True)).float().sum()
        weights = [layer[1].weight, layer[1].bias, layer[3].weight, layer[3].bias]
        with WeightCasts(weights) as casts:
            loss.backward()
        return casts.count

    assert backward_casts("none") == 0
    assert backward_casts(policy) == 4  # both linears' weights and biases, cast again


def test_selective_recompute_keeps_every_fused_attention_sdpa_may_pick():
    """The cost model prices selective recompute as repeating no attention (`stage_costs`). SDPA picks
    its fused kernel by device: cuDNN's on the H100 and H200 under torch 2.11 (the af063d4 diagnosis),
    flash on CPU. The runtime's policy must keep the outputs of each, or the GPU repeats attention."""
    from torch.utils.checkpoint import CheckpointPolicy

    from autopar.runtime.recompute import _selective_policy

    fused = [getattr(torch.ops.aten, name).default for name in dir(torch.ops.aten)
             if name.startswith("_scaled_dot_product_") and name.endswith(("attention", "attention_for_cpu",
                                                                           "attention_overrideable"))
             and "math" not in name]
    names = {op.name() for op in fused}
    assert {"aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention",
            "aten::_scaled_dot_product_efficient_attention"} <= names
    assert {op.name() for op in fused if _selective_policy(None, op) != CheckpointPolicy.MUST_SAVE} == set()
    assert _selective_policy(None, torch.ops.aten.gelu.default) == CheckpointPolicy.PREFER_RECOMPUTE


def test_selective_recompute_does_not_run_attention_again_in_backward():
    """On CPU, where SDPA runs its flash kernel for CPU: one call in forward, none in backward."""
    from autopar.runtime.recompute import apply_recompute

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.project = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.project(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).tanh().sum()

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += "scaled_dot_product" in func.name() and "backward" not in func.name()
            return func(*args, **(kwargs or {}))

    model = torch.nn.ModuleDict({"attention": Attention()})
    apply_recompute(model, ["attention"], "selective")
    with Calls() as forward:
        loss = model["attention"](torch.randn(2, 8, 16))
    with Calls() as backward:
        loss.backward()
    assert forward.count == 1 and backward.count == 0


def test_pipeline_stages_without_recompute_cast_each_weight_once_per_step():
    """The runtime runs a pipeline schedule in one autocast region (`ParallelModel.forward_backward`):
    without recompute nothing leaves autocast before the step ends, so each weight is cast once,
    whatever the micro-batches (here four, forward and backward interleaved as 1F1B does), and the
    weight-pass term charges each micro-batch a 1/n share. With recompute, or without stages, a
    cast per micro-batch stays priced."""
    from autopar.cost_models.weight_passes import CAST_FORWARD_BYTES, weight_pass_bytes
    from autopar.runtime.precision import autocast

    stage = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    weights = [p for p in stage.parameters()]
    with WeightCasts(weights) as casts, autocast("bf16", torch.device("cpu"), fsdp=False):
        for _ in range(4):
            stage(torch.randn(2, 16)).float().sum().backward()
    assert casts.count == len(weights)

    params, cast = 1000.0, CAST_FORWARD_BYTES * 1000.0
    piped = Strategy(dp=1, tp=1, pp=2, microbatch=1, num_microbatches=4)
    assert weight_pass_bytes(params, 0.0, piped, "bf16")[0] == pytest.approx(cast / 4)
    recomputed = piped.model_copy(update={"recompute": "full"})
    assert weight_pass_bytes(params, params, recomputed, "bf16")[0] == pytest.approx(cast)
    no_layer = piped.model_copy(update={"recompute": "full", "recompute_layers": (0, 0)})  # nothing recomputes
    assert weight_pass_bytes(params, 0.0, no_layer, "bf16")[0] == pytest.approx(cast / 4)
    flat = piped.model_copy(update={"pp": 1})
    assert weight_pass_bytes(params, 0.0, flat, "bf16")[0] == pytest.approx(cast)


def test_autocast_bytes_counts_the_vector_ops_autocast_widens(monkeypatch):
    """benchmarks/autocast_bytes.py on a small GPT: under autocast over fp32 weights a layer norm reads
    and writes fp32 where the 16-bit step moves bf16 (twice the bytes); a GELU between two linears
    stays bf16 (the same bytes); GEMMs, attention and the weights' own casts are not counted."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import autocast_bytes

    traced, runtime, ratio = autocast_bytes.compare("gpt", "layers=2,hidden=64,heads=4,vocab=128,seq_len=32", 2, 32)
    assert runtime["native_layer_norm"] == 2 * traced["native_layer_norm"]
    assert runtime["gelu"] == traced["gelu"]
    assert not {"mm", "addmm", "bmm"} & (set(traced) | set(runtime))
    assert not any("scaled_dot_product" in packet for packet in runtime)
    assert ratio > 1.2
    # the weights' casts (forward) and their gradients' casts back, priced as weight passes: left out
    monkeypatch.setattr(autocast_bytes.Bytes, "_weight_cast", lambda self, func, args, out: False)
    _, counted_all, _ = autocast_bytes.compare("gpt", "layers=2,hidden=64,heads=4,vocab=128,seq_len=32", 2, 32)
    linear_weights = 2 * 12 * 64 * 64  # two layers of qkv and proj (4 h²), fc1 and fc2 (8 h²); biases aside
    # each cast to bf16 (read 4 B, write 2) and its gradient cast back (read 2, write 4)
    assert counted_all["_to_copy"] - runtime["_to_copy"] >= 12 * linear_weights
