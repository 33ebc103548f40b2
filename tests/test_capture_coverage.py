"""Capture coverage over models nobody here wrote: Hugging Face GPT-2, Llama, BERT, T5 and Mixtral,
torchvision ResNet-50 and ViT-B/16, and a timm ViT, each built small (or, for the vision models, at
their real size) on the meta device and traced for one training step.

Every model is checked the same way: forward and backward ops are both there; forward FLOPs match
a count made by hand from the config (2 × matmul weights × tokens that use them, plus 4·b·s_q·s_k·d
for QKᵀ and AV per attention layer, MoE counting only the experts a token is routed to); backward
is about twice forward; the repeated blocks come out as one layer type with the right instances and
per-instance FLOPs; every parameter is read by some op; backward ops carry module paths.

torchvision and timm are not importable beside this torch (torchvision's compiled ops are built for
another version), so their tests skip with the reason; they run for real wherever they import. Two
small models built here exercise the same code paths (convolution + batch norm + residual stages,
and `nn.MultiheadAttention`) so those paths are covered either way.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from autopar.errors import CaptureError
from autopar.graph import OpGraph, trace

transformers = pytest.importorskip("transformers")

BATCH, SEQ = 2, 32


@dataclass
class Case:
    model: nn.Module
    inputs: object
    forward_flops: int  # analytic
    # instances of a repeated block → (class name, analytic forward FLOPs of one instance)
    layer_types: dict[tuple[str, ...], tuple[str, int]]
    precision: str = "fp32"
    loss_fn: object = None
    not_a_type: list[str] = field(default_factory=list)  # blocks that must not join a layer type


def _ids(batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.zeros(batch, seq, dtype=torch.long, device="meta")


def _attention(batch: int, q_len: int, k_len: int, width: int) -> int:
    """QKᵀ and AV: two matmuls of 2·b·s_q·s_k·d FLOPs each (full, not causal-halved: what is traced)."""
    return 4 * batch * q_len * k_len * width


def _blocks(prefix: str, first: int, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}.{i}" for i in range(first, count))


def _import_or_skip(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        pytest.skip(f"{error.name} is not installed (installing it from PyPI would replace this CPU torch)")
    except Exception as error:  # a torchvision built for another torch raises RuntimeError, not ImportError
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        pytest.skip(f"{module} cannot be imported beside torch {torch.__version__}: {type(error).__name__}: {reason}")


def _on_meta(build):
    """Build on the meta device; a library that reads values while initializing gets the CPU."""
    try:
        with torch.device("meta"):
            return build()
    except Exception:
        return build()


# --- Hugging Face transformers ------------------------------------------------------------------
def gpt2() -> Case:
    layers, h, vocab = 2, 64, 512
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=h, n_head=4, vocab_size=vocab, n_positions=128, bos_token_id=0, eos_token_id=0
    )
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    tokens = BATCH * SEQ
    block = 2 * 12 * h * h * tokens + _attention(BATCH, SEQ, SEQ, h)  # c_attn 3h², c_proj h², MLP 8h²
    lm_head = 2 * vocab * h * tokens  # tied to the input embedding, which is a lookup
    return Case(
        model, {"input_ids": _ids(), "labels": _ids()},
        forward_flops=layers * block + lm_head,
        layer_types={_blocks("transformer.h", 0, layers): ("GPT2Block", block)},
    )


def llama() -> Case:
    layers, h, ffn, heads, kv_heads, vocab = 2, 64, 128, 4, 2, 512
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=h, intermediate_size=ffn, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=128,
        bos_token_id=0, eos_token_id=1, pad_token_id=None,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    tokens, head_dim = BATCH * SEQ, h // heads
    attention_weights = h * h + 2 * h * kv_heads * head_dim + h * h  # q, k and v (grouped), o
    block = 2 * (attention_weights + 3 * h * ffn) * tokens + _attention(BATCH, SEQ, SEQ, h)
    lm_head = 2 * vocab * h * tokens  # untied
    return Case(
        model, {"input_ids": _ids(), "labels": _ids()},
        forward_flops=layers * block + lm_head,
        layer_types={_blocks("model.layers", 0, layers): ("LlamaDecoderLayer", block)},
    )


def bert() -> Case:
    layers, h, ffn, vocab = 2, 64, 256, 512
    config = transformers.BertConfig(
        num_hidden_layers=layers, hidden_size=h, intermediate_size=ffn, num_attention_heads=4,
        vocab_size=vocab, max_position_embeddings=128, pad_token_id=0,
    )
    with torch.device("meta"):
        model = transformers.BertForMaskedLM(config)
    tokens = BATCH * SEQ
    block = 2 * (4 * h * h + 2 * h * ffn) * tokens + _attention(BATCH, SEQ, SEQ, h)
    mlm_head = 2 * (h * h + vocab * h) * tokens  # transform dense, then the decoder tied to the embedding
    return Case(
        model, {"input_ids": _ids(), "labels": _ids()},
        forward_flops=layers * block + mlm_head,
        layer_types={_blocks("bert.encoder.layer", 0, layers): ("BertLayer", block)},
    )


def t5() -> Case:
    """Encoder and decoder lengths differ so cross-attention's K/V (on encoder tokens) count apart."""
    layers, d, heads, d_kv, ffn, vocab = 3, 96, 4, 16, 128, 512
    enc_len, dec_len = SEQ, SEQ // 2
    config = transformers.T5Config(
        num_layers=layers, num_decoder_layers=layers, d_model=d, d_kv=d_kv, d_ff=ffn, num_heads=heads,
        vocab_size=vocab, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(config)
    inner = heads * d_kv
    enc_tokens, dec_tokens = BATCH * enc_len, BATCH * dec_len
    encoder_block = 2 * (4 * d * inner + 2 * d * ffn) * enc_tokens + _attention(BATCH, enc_len, enc_len, inner)
    decoder_block = (
        2 * (4 * d * inner + 2 * d * ffn) * dec_tokens + _attention(BATCH, dec_len, dec_len, inner)  # self + MLP
        + 2 * (2 * d * inner) * dec_tokens + 2 * (2 * d * inner) * enc_tokens  # cross: q, o | k, v
        + _attention(BATCH, dec_len, enc_len, inner)
    )
    lm_head = 2 * vocab * d * dec_tokens
    # Block 0 of each stack owns the relative position bias, so only blocks 1..n-1 are identical.
    return Case(
        model, {"input_ids": _ids(BATCH, enc_len), "decoder_input_ids": _ids(BATCH, dec_len),
                "labels": _ids(BATCH, dec_len)},
        forward_flops=layers * (encoder_block + decoder_block) + lm_head,
        layer_types={
            _blocks("encoder.block", 1, layers): ("T5Block", encoder_block),
            _blocks("decoder.block", 1, layers): ("T5Block", decoder_block),
        },
        not_a_type=["encoder.block.0", "decoder.block.0"],
    )


def _mixtral_config(**overrides):
    if not hasattr(transformers, "MixtralForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no MixtralForCausalLM")
    settings = dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
        bos_token_id=0, eos_token_id=1, pad_token_id=None,
    )
    settings.update(overrides)
    return transformers.MixtralConfig(**settings)


def mixtral() -> Case:
    """Transformers' grouped-GEMM experts: tokens sorted by expert, one grouped matmul per projection,
    no data-dependent shapes. Torch's fake grouped GEMM accepts only bf16, hence the precision."""
    config = _mixtral_config(experts_implementation="grouped_mm")
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config)
    h, ffn, heads, kv_heads = config.hidden_size, config.intermediate_size, 4, 2
    tokens, head_dim, top_k, experts = BATCH * SEQ, h // heads, config.num_experts_per_tok, config.num_local_experts
    attention_weights = 2 * h * h + 2 * h * kv_heads * head_dim
    active_expert_weights = top_k * 3 * h * ffn  # each token runs only its top-k experts' gate, up, down
    block = 2 * (attention_weights + experts * h + active_expert_weights) * tokens + _attention(BATCH, SEQ, SEQ, h)
    lm_head = 2 * config.vocab_size * h * tokens
    return Case(
        model, {"input_ids": _ids(), "labels": _ids()},
        forward_flops=config.num_hidden_layers * block + lm_head,
        layer_types={_blocks("model.layers", 0, config.num_hidden_layers): ("MixtralDecoderLayer", block)},
        precision="bf16",
    )


# --- vision: built here (always run) ---------------------------------------------------------------
def _conv_flops(c_in: int, c_out: int, kernel: int, out_side: int, batch: int) -> int:
    return 2 * c_out * c_in * kernel * kernel * out_side * out_side * batch


class _Residual(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.downsample is None else self.downsample(x)
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + skip)


class _TinyResNet(nn.Module):
    """Stages whose first block downsamples, as in ResNet: batch-norm buffers updated in training."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False)
        self.stage1 = nn.Sequential(_Residual(16, 16, 1), _Residual(16, 16, 1))
        self.stage2 = nn.Sequential(_Residual(16, 32, 2), _Residual(32, 32, 1), _Residual(32, 32, 1))
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.stage2(self.stage1(self.stem(x))).mean((2, 3)))


def tiny_resnet() -> Case:
    with torch.device("meta"):
        model = _TinyResNet()
    b = BATCH
    stage1_block = 2 * _conv_flops(16, 16, 3, 16, b)
    stage2_block = 2 * _conv_flops(32, 32, 3, 8, b)
    forward = (
        _conv_flops(3, 16, 3, 16, b) + 2 * stage1_block
        + _conv_flops(16, 32, 3, 8, b) + _conv_flops(32, 32, 3, 8, b) + _conv_flops(16, 32, 1, 8, b)
        + 2 * stage2_block + 2 * 32 * 10 * b
    )
    return Case(
        model, (torch.empty(b, 3, 32, 32, device="meta"),),
        forward_flops=forward,
        layer_types={("stage1.0", "stage1.1"): ("_Residual", stage1_block),
                     ("stage2.1", "stage2.2"): ("_Residual", stage2_block)},
        not_a_type=["stage2.0"],
    )


def torch_mha_encoder() -> Case:
    """`nn.MultiheadAttention` (what torchvision's ViT uses) inside torch's own encoder layer."""
    layers, h, ffn, seq = 4, 64, 256, 16
    with torch.device("meta"):
        model = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(h, 4, ffn, batch_first=True), layers, enable_nested_tensor=False
        )
    block = 2 * (4 * h * h + 2 * h * ffn) * BATCH * seq + _attention(BATCH, seq, seq, h)
    return Case(
        model, (torch.empty(BATCH, seq, h, device="meta"),),
        forward_flops=layers * block,
        layer_types={_blocks("layers", 0, layers): ("TransformerEncoderLayer", block)},
    )


# --- vision: torchvision and timm (skip where they do not import) ----------------------------------
def resnet50() -> Case:
    models = _import_or_skip("torchvision.models")
    model = _on_meta(lambda: models.resnet50(weights=None))
    b = BATCH
    # (mid width, out width, blocks, output side) per stage; the 3×3 conv strides (ResNet v1.5)
    stages = [(64, 256, 3, 56), (128, 512, 4, 28), (256, 1024, 6, 14), (512, 2048, 3, 7)]
    forward = _conv_flops(3, 64, 7, 112, b) + 2 * 2048 * 1000 * b
    c_in, side_in = 64, 56
    layer_types = {}
    for stage, (mid, out, count, side) in enumerate(stages, start=1):
        first = (_conv_flops(c_in, mid, 1, side_in, b) + _conv_flops(mid, mid, 3, side, b)
                 + _conv_flops(mid, out, 1, side, b) + _conv_flops(c_in, out, 1, side, b))
        block = _conv_flops(out, mid, 1, side, b) + _conv_flops(mid, mid, 3, side, b) + _conv_flops(mid, out, 1, side, b)
        forward += first + (count - 1) * block
        layer_types[_blocks(f"layer{stage}", 1, count)] = ("Bottleneck", block)  # block 0 has the downsample
        c_in, side_in = out, side
    assert abs(forward / (2 * b) - 4.09e9) / 4.09e9 < 0.01  # torchvision documents 4.09 GMAC per image
    return Case(
        model, (torch.empty(b, 3, 224, 224, device="meta"),), forward_flops=forward, layer_types=layer_types,
        not_a_type=[f"layer{stage}.0" for stage in range(1, 5)],
    )


def _vit_flops(b: int, side: int, patch: int, h: int, mlp: int, layers: int, classes: int, prefix_tokens: int = 1):
    patches = (side // patch) ** 2
    seq = patches + prefix_tokens
    block = 2 * (4 * h * h + 2 * h * mlp) * b * seq + _attention(b, seq, seq, h)
    patch_embedding = _conv_flops(3, h, patch, side // patch, b)
    head = 2 * h * classes * b  # on the class token only
    return layers * block + patch_embedding + head, block


def vit_b_16() -> Case:
    models = _import_or_skip("torchvision.models")
    model = _on_meta(lambda: models.vit_b_16(weights=None))
    layers = len(model.encoder.layers)
    forward, block = _vit_flops(BATCH, 224, 16, model.hidden_dim, model.mlp_dim, layers, 1000)
    assert abs(forward / (2 * BATCH) - 17.6e9) / 17.6e9 < 0.01  # torchvision documents 17.6 GMAC per image
    return Case(
        model, (torch.empty(BATCH, 3, 224, 224, device="meta"),), forward_flops=forward,
        layer_types={tuple(f"encoder.layers.encoder_layer_{i}" for i in range(layers)): ("EncoderBlock", block)},
    )


def timm_vit() -> Case:
    timm = _import_or_skip("timm")
    model = _on_meta(lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False))
    layers = len(model.blocks)
    forward, block = _vit_flops(
        BATCH, 224, 16, model.embed_dim, model.blocks[0].mlp.fc1.out_features, layers,
        model.head.out_features, prefix_tokens=model.num_prefix_tokens,
    )
    return Case(
        model, (torch.empty(BATCH, 3, 224, 224, device="meta"),), forward_flops=forward,
        layer_types={_blocks("blocks", 0, layers): ("Block", block)},
    )


CASES = {f.__name__: f for f in (gpt2, llama, bert, t5, mixtral, tiny_resnet, torch_mha_encoder,
                                  resnet50, vit_b_16, timm_vit)}


@pytest.fixture(scope="module", params=list(CASES))
def traced(request) -> tuple[Case, OpGraph]:
    case = CASES[request.param]()
    graph = trace(case.model, case.inputs, loss_fn=case.loss_fn, precision=case.precision, name=request.param)
    return case, graph


# --- the checks, the same for every model -----------------------------------------------------------
def test_graph_holds_forward_and_backward(traced):
    _, graph = traced
    phases = [node.phase for node in graph.nodes]
    assert "forward" in phases and "backward" in phases
    assert phases.index("backward") > phases.index("forward")
    assert graph.backward_flops > 0


def test_forward_flops_match_the_analytic_count(traced):
    case, graph = traced
    assert graph.forward_flops == pytest.approx(case.forward_flops, rel=0.03)


def test_backward_is_about_twice_forward(traced):
    _, graph = traced
    assert 1.8 <= graph.backward_flops / graph.forward_flops <= 2.6


def test_repeated_blocks_are_layer_types(traced):
    case, graph = traced
    found = {tuple(layer_type.instances): layer_type for layer_type in graph.layer_types}
    for instances, (class_name, block_flops) in case.layer_types.items():
        assert instances in found, f"{instances} not a layer type; found {[lt.instances for lt in graph.layer_types]}"
        layer_type = found[instances]
        assert layer_type.class_name == class_name
        assert layer_type.forward_flops_per_instance == pytest.approx(block_flops, rel=0.03)
        assert layer_type.backward_flops_per_instance > 1.5 * layer_type.forward_flops_per_instance
        instance_params = sum(p.numel() for p in case.model.get_submodule(instances[0]).parameters())
        assert layer_type.params_per_instance == instance_params
    in_a_type = {path for layer_type in graph.layer_types for path in layer_type.instances}
    assert not in_a_type & set(case.not_a_type)


def test_every_parameter_is_read_by_some_op(traced):
    case, graph = traced
    read = {name for node in graph.nodes for name in node.params}
    canonical = {alias: info.name for info in graph.params for alias in (info.name, *info.aliases)}
    unread = [name for name, _ in case.model.named_parameters(remove_duplicate=False) if canonical[name] not in read]
    assert not unread


def test_backward_ops_carry_module_paths(traced):
    _, graph = traced
    backward = [node for node in graph.nodes if node.phase == "backward"]
    # Only what the root module's own forward and the loss compute belongs to no submodule.
    assert sum(bool(node.module_path) for node in backward) >= 0.85 * len(backward)
    unattributed = [node.op for node in backward if (node.flops or node.params) and not node.module_path]
    assert not unattributed  # every backward matmul, convolution, attention and weight read names its module
    in_blocks = {node.layer for node in backward if node.layer}
    expected = {path for instances in traced[0].layer_types for path in instances}
    assert expected <= in_blocks


# --- what cannot be traced fails cleanly ------------------------------------------------------------
class _Router(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.how == "branch":
            return h if h.sum() > 0 else -h
        if self.how == "tolist":
            return h[: int(h.argmax().tolist()) + 1]
        return h[h > 0]  # boolean mask: an output size that depends on the values


class _Untraceable(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.blocks = nn.Sequential(nn.ReLU(), _Router(how))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.embed(x))


@pytest.mark.parametrize("how", ["branch", "tolist", "mask"])
def test_data_dependent_model_raises_one_line_capture_error(how):
    with torch.device("meta"):
        model = _Untraceable(how)
    with pytest.raises(CaptureError) as caught:
        trace(model, torch.empty(4, 16, device="meta"))
    message = str(caught.value)
    assert "\n" not in message
    assert "in module 'blocks.1' (_Router.forward)" in message
    assert "depend on tensor values" in message
    assert caught.value.in_model_code


def test_moe_counts_only_the_experts_each_token_is_routed_to():
    case = mixtral()
    graph = trace(case.model, case.inputs, precision=case.precision)
    config = case.model.config
    expert_ops = [n for n in graph.nodes if n.phase == "forward" and n.module_path.endswith("mlp.experts") and n.flops]
    assert {n.op for n in expert_ops} == {"aten._grouped_mm.default"}
    active = config.num_experts_per_tok * 3 * config.hidden_size * config.intermediate_size
    assert sum(n.flops for n in expert_ops) == 2 * active * BATCH * SEQ * config.num_hidden_layers
    assert {p for n in expert_ops for p in n.params} == {
        f"model.layers.{i}.mlp.experts.{w}" for i in range(config.num_hidden_layers) for w in ("gate_up_proj", "down_proj")
    }


def test_moe_eager_experts_loop_is_a_clean_capture_error():
    """Transformers' eager experts loop over `nonzero()` of the routing mask: a Python loop whose
    trip count is data, so no shape-only trace can follow it."""
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(_mixtral_config(experts_implementation="eager"))
    with pytest.raises(CaptureError) as caught:
        trace(model, {"input_ids": _ids(), "labels": _ids()}, precision="bf16")
    message = str(caught.value)
    assert "\n" not in message
    assert "in module 'model.layers.0.mlp.experts' (MixtralExperts.forward)" in message
    assert caught.value.in_model_code


def test_moe_grouped_gemm_traces_in_fp32_with_the_bf16_graphs_work():
    """Outside bf16 (which torch's fake kernel insists on) the experts trace as autopar::grouped_mm:
    the same contractions, forward and backward, at the model's own dtype and with the same FLOPs."""
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(_mixtral_config(experts_implementation="grouped_mm"))
    inputs = {"input_ids": _ids(), "labels": _ids()}
    fp32, bf16 = trace(model, inputs, precision="fp32"), trace(model, inputs, precision="bf16")
    grouped = [n for n in fp32.nodes if n.op == "autopar.grouped_mm.default"]
    assert {n.phase for n in grouped} == {"forward", "backward"}
    assert all(n.module_path.startswith("model.layers.") for n in grouped)
    assert sum(n.flops for n in grouped) == sum(n.flops for n in bf16.nodes if n.op == "aten._grouped_mm.default") > 0
    assert fp32.forward_flops == bf16.forward_flops


def test_grouped_mm_stand_in_computes_and_differentiates_the_grouped_contraction():
    from autopar.graph.grouped_mm import grouped_mm

    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(7, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    experts = torch.randn(2, 3, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    offs = torch.tensor([3, 7], dtype=torch.int32)
    expected = torch.cat([rows[:3] @ experts[0], rows[3:] @ experts[1]])
    torch.testing.assert_close(grouped_mm(rows, experts, offs), expected)
    assert torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, offs), (rows, experts))
