"""Graph capture: FLOPs against analytic counts, module attribution, layer types, memory facts."""

import pytest
import torch
from torch import nn

from autopar.errors import CaptureError
from autopar.graph import OpGraph, trace
from autopar.models import build_model

SMALL_GPT = "layers=4,hidden=256,heads=8,vocab=2000,seq_len=128"
SMALL_LLAMA = "layers=3,hidden=256,heads=8,kv_heads=2,ffn_hidden=512,vocab=2000,seq_len=128"


def _trace(name, overrides=None, batch=2, seq=None, precision="fp32"):
    spec = build_model(name, overrides)
    return spec, trace(spec.module, spec.example_inputs(batch, seq), loss_fn=spec.loss_fn, precision=precision, name=name)


def analytic_forward_flops(spec, graph):
    """2·params·tokens for the matmuls, plus 4·b·s²·h·layers for QKᵀ and AV (full, not causal-halved).

    An untied input embedding is a lookup, not a matmul, so its parameters do not count.
    """
    config = spec.config
    tokens = graph.batch * graph.seq_len
    matmul_params = graph.num_params - (0 if config.tied else config.padded_vocab * config.hidden)
    return 2 * matmul_params * tokens + 4 * graph.batch * graph.seq_len**2 * config.hidden * config.layers


@pytest.fixture(scope="module")
def gpt():
    return _trace("gpt", SMALL_GPT)


@pytest.fixture(scope="module")
def llama():
    return _trace("llama", SMALL_LLAMA, precision="bf16")


@pytest.mark.parametrize("fixture", ["gpt", "llama"])
def test_forward_flops_match_analytic_and_backward_is_twice(fixture, request):
    spec, graph = request.getfixturevalue(fixture)
    expected = analytic_forward_flops(spec, graph)
    assert abs(graph.forward_flops - expected) / expected < 0.02
    assert 1.9 < graph.backward_flops / graph.forward_flops < 2.2


def test_attention_is_the_fused_kernel_not_a_materialized_score_matrix(gpt):
    _, graph = gpt
    ops = {node.op for node in graph.nodes}
    assert "aten._scaled_dot_product_flash_attention.default" in ops
    assert "aten._scaled_dot_product_flash_attention_backward.default" in ops
    seq = graph.seq_len
    assert not any(seq * seq in (m.numel for m in node.output_meta) and node.op.startswith("aten.bmm")
                   for node in graph.nodes)


def test_every_matmul_is_attributed_to_its_linear_in_forward_and_backward(gpt):
    _, graph = gpt
    q_proj_ops = [n for n in graph.nodes if n.module_path == "layers.2.attn.q_proj" and n.flops]
    phases = {n.phase for n in q_proj_ops}
    assert phases == {"forward", "backward"}
    forward = [n for n in q_proj_ops if n.phase == "forward"]
    assert forward[0].params == ["layers.2.attn.q_proj.bias", "layers.2.attn.q_proj.weight"]
    backward_with_weight_grad = [n for n in q_proj_ops if n.phase == "backward"]
    assert len(backward_with_weight_grad) == 2  # grad wrt input and wrt weight
    # Every op with FLOPs sits in some module: no orphan matmuls at the top level but the loss's.
    assert all(n.module_path for n in graph.nodes if n.flops)


def test_parameters_and_tied_head(gpt):
    _, graph = gpt
    names = {p.name for p in graph.params}
    read = set().union(*(set(n.params) for n in graph.nodes))
    assert names <= read
    embed = next(p for p in graph.params if p.name == "embed.weight")
    assert embed.aliases == ["head.weight"]
    head_ops = [n for n in graph.nodes if n.module_path == "head" and n.flops and n.phase == "forward"]
    assert head_ops and head_ops[0].params == ["embed.weight"]


def test_layer_types_and_their_instances(gpt, llama):
    for (spec, graph) in (gpt, llama):
        assert len(graph.layer_types) == 1
        layer_type = graph.layer_types[0]
        assert layer_type.instances == [f"layers.{i}" for i in range(spec.config.layers)]
        in_layers = [n for n in graph.nodes if n.module_path.startswith("layers.")]
        assert all(n.layer_type == layer_type.id for n in in_layers)
        per_layer = sum(n.flops for n in in_layers if n.layer == "layers.0" and n.phase == "forward")
        assert per_layer == layer_type.forward_flops_per_instance > 0


def test_heterogeneous_blocks_are_separate_types():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.wide = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
            self.narrow = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
            self.odd = nn.Linear(64, 32)

        def forward(self, x):
            for layer in self.wide:
                x = torch.relu(layer(x))
            for layer in self.narrow:
                x = torch.tanh(layer(x))
            return self.odd(x)

    graph = trace(Model(), torch.randn(4, 64))
    types = sorted((lt.instances[0].split(".")[0], len(lt.instances)) for lt in graph.layer_types)
    assert types == [("narrow", 2), ("wide", 3)]


def test_gpt3_175b_is_captured_without_memory_and_has_96_identical_blocks():
    spec, graph = _trace("gpt3-175b", batch=1, precision="bf16")
    assert len(graph.layer_types) == 1
    assert len(graph.layer_types[0].instances) == 96
    expected = analytic_forward_flops(spec, graph)
    assert abs(graph.forward_flops - expected) / expected < 0.02
    assert graph.step_memory.param_bytes == 2 * graph.num_params
    assert graph.step_memory.optimizer_state_bytes == 12 * graph.num_params


def test_step_memory_by_precision(gpt):
    _, graph = gpt  # fp32: weight 4, grad 4, Adam moments 8, no separate master copy
    n = graph.num_params
    memory = graph.step_memory
    assert (memory.param_bytes, memory.grad_bytes, memory.optimizer_state_bytes) == (4 * n, 4 * n, 8 * n)


def test_saved_activations_are_forward_outputs_read_by_backward(gpt):
    _, graph = gpt
    saved = [n for n in graph.nodes if n.saved_bytes]
    assert saved and all(n.phase == "forward" for n in saved)
    # The attention output of every layer is saved for the flash backward.
    attention = [n for n in saved if "flash_attention" in n.op]
    assert len(attention) == 4


def test_json_round_trip_and_networkx(gpt):
    _, graph = gpt
    again = OpGraph.from_json(graph.to_json())
    assert again == graph
    digraph = graph.to_networkx()
    assert digraph.number_of_edges() == sum(len(n.inputs) for n in graph.nodes)
    assert set(n.name for n in graph.nodes) <= set(digraph.nodes)


def test_trace_leaves_a_real_model_untouched():
    spec = build_model("gpt", "layers=1,hidden=32,heads=2,vocab=50,seq_len=8", device="cpu", seed=0)
    before = {k: v.clone() for k, v in spec.module.state_dict().items()}
    trace(spec.module, spec.example_inputs(2, device="cpu"), loss_fn=spec.loss_fn, precision="bf16")
    after = spec.module.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].dtype == torch.float32 for k in before)


def test_wrong_input_shape_names_the_module():
    spec = build_model("llama", "layers=1,hidden=32,heads=2,vocab=50,seq_len=8")
    with pytest.raises(CaptureError) as caught:
        trace(spec.module, torch.zeros(2, 3, 4, 5, dtype=torch.long), loss_fn=spec.loss_fn)
    message = str(caught.value)
    assert "in module 'layers.0.attn' (CausalSelfAttention.forward)" in message
    assert caught.value.in_model_code and "\n" not in message
    gpt = build_model("gpt", "layers=1,hidden=32,heads=2,vocab=50,seq_len=8")
    with pytest.raises(CaptureError, match=r"in GPT.forward \(top level\)"):
        trace(gpt.module, torch.zeros(2, 3, 4, 5, dtype=torch.long), loss_fn=gpt.loss_fn)


def test_model_without_trainable_parameters():
    frozen = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(CaptureError, match="no trainable parameters"):
        trace(frozen, torch.randn(2, 4))
