"""A public zoo of models no one on the project wrote, built from configs (no download), tiny.

Hugging Face causal, masked, encoder-decoder, vision and audio models, and plain-torch oddities.
Each entry gives the model (its own initialization, seeded), one global batch of inputs, and a loss
`loss_fn(output, inputs)`. The runtime trains on one input tensor per batch (the token ids, the
pixels, the waveform), so encoder-decoder models get a thin wrapper feeding the same ids to the
decoder; everything else is the library's class as a user builds it. Hugging Face models keep
their library's defaults (a causal LM's `use_cache=True`, the default attention implementation):
only sizes are set, and dropout is off so that one process and a plan compute the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

VOCAB = 96
SEQ = 16
IMAGE = 32
AUDIO_SAMPLES = 800


@dataclass(frozen=True)
class ZooModel:
    name: str
    family: str  # causal, masked, seq2seq, vision, audio, plain
    build: Callable[[], nn.Module]
    inputs: Callable[[int, torch.Generator], torch.Tensor]  # (batch, generator) -> one global batch
    loss_fn: Callable
    linear_blocks: bool = True  # its repeated blocks hold Linear projections (tp applies)
    repeated_blocks: int = 2  # blocks of the outermost repeated stack (pp applies when >= 2)

    def example(self) -> torch.Tensor:
        """Two samples on the meta device, for planning: a batch of two tells the planner which
        tensors grow with the batch (Whisper's decoder ids are built to the batch size)."""
        return self.inputs(2, torch.Generator().manual_seed(0)).to("meta")


def _logits(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0] if isinstance(output, tuple) else output


def next_token_loss(output, ids: torch.Tensor) -> torch.Tensor:
    logits = _logits(output)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def same_token_loss(output, ids: torch.Tensor) -> torch.Tensor:
    """Masked LMs and encoder-decoders here predict each position's own token."""
    logits = _logits(output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids.reshape(-1))


def class_loss(output, pixels: torch.Tensor) -> torch.Tensor:
    """Classification with a label derived from the input (the mean brightness's sign per sample)."""
    logits = _logits(output)
    if logits.dim() > 2:  # a backbone's hidden states: pool them
        logits = logits.mean(dim=tuple(range(1, logits.dim() - 1)))
    labels = (pixels.flatten(1).mean(1) > 0).long() % logits.shape[-1]
    return F.cross_entropy(logits.float(), labels)


def ctc_like_loss(output, waveform: torch.Tensor) -> torch.Tensor:
    logits = _logits(output)
    labels = (waveform.flatten(1).mean(1) > 0).long() % logits.shape[-1]
    return F.cross_entropy(logits.mean(1).float(), labels)


def _ids(batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, SEQ), generator=generator)


def _pixels(batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, 3, IMAGE, IMAGE, generator=generator)


def _waveform(batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, AUDIO_SAMPLES, generator=generator)


class Seq2Seq(nn.Module):
    """Feeds the ids to both encoder and decoder (the runtime trains on one input tensor)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor):
        return self.model(input_ids=ids, decoder_input_ids=ids).logits


class WhisperLike(nn.Module):
    """Whisper's encoder takes mel features: the batch holds them flattened, decoder ids fixed."""

    def __init__(self, model: nn.Module, mels: int, frames: int) -> None:
        super().__init__()
        self.model, self.mels, self.frames = model, mels, frames

    def forward(self, features: torch.Tensor):
        features = features.view(features.shape[0], self.mels, self.frames)
        ids = torch.arange(8, device=features.device).remainder(VOCAB).expand(features.shape[0], 8)
        return self.model(input_features=features, decoder_input_ids=ids).logits


class PlainMHA(nn.Module):
    """nn.MultiheadAttention blocks, a learned mask token no matmul reads, a conv stem."""

    def __init__(self, hidden: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, hidden))
        self.blocks = nn.ModuleList(_MHABlock(hidden, heads) for _ in range(layers))
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.mask_token
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _MHABlock(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class PlainTransformer(nn.Module):
    """torch's own nn.TransformerEncoder (fused MultiheadAttention weights)."""

    def __init__(self, hidden: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))


class PlainCNN(nn.Module):
    """Convolutions only: no Linear projections in its repeated blocks."""

    def __init__(self, channels: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU())
                                      for _ in range(layers)))
        self.classifier = nn.Linear(channels, 2)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.blocks(self.stem(pixels)).mean((2, 3)))


def _hf(class_name: str, config_name: str, **settings) -> Callable[[], nn.Module]:
    """The class built from its config with Hugging Face's defaults (use_cache on, the default
    attention) but for the sizes and dropout (off: one process and a plan must compute the same)."""
    def build() -> nn.Module:
        import transformers

        config = getattr(transformers, config_name)(**settings)
        return getattr(transformers, class_name)(config)

    return build


def _wrapped(wrapper, inner: Callable[[], nn.Module], **kwargs) -> Callable[[], nn.Module]:
    return lambda: wrapper(inner(), **kwargs)


_LM = dict(vocab_size=VOCAB)
_DECODER = dict(_LM, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64)
_ENCODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_VISION = dict(image_size=IMAGE, num_channels=3, num_labels=2)
_VIT = dict(_VISION, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=8,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def zoo() -> list[ZooModel]:
    causal = [
        ("llama", "LlamaForCausalLM", "LlamaConfig", dict(_DECODER, num_key_value_heads=2)),
        ("mistral", "MistralForCausalLM", "MistralConfig", dict(_DECODER, num_key_value_heads=2)),
        ("qwen2", "Qwen2ForCausalLM", "Qwen2Config", dict(_DECODER, num_key_value_heads=2)),
        ("qwen3", "Qwen3ForCausalLM", "Qwen3Config", dict(_DECODER, num_key_value_heads=2, head_dim=8)),
        ("gemma", "GemmaForCausalLM", "GemmaConfig", dict(_DECODER, num_key_value_heads=2, head_dim=8)),
        ("phi3-fused-qkv", "Phi3ForCausalLM", "Phi3Config", dict(_DECODER, num_key_value_heads=4, pad_token_id=0)),
        ("stablelm", "StableLmForCausalLM", "StableLmConfig", dict(_DECODER, num_key_value_heads=4)),
        ("gpt-neox-fused-qkv", "GPTNeoXForCausalLM", "GPTNeoXConfig", dict(_DECODER, attention_dropout=0.0,
                                                                          hidden_dropout=0.0)),
        ("gpt2-conv1d", "GPT2LMHeadModel", "GPT2Config", dict(_LM, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        ("opt", "OPTForCausalLM", "OPTConfig", dict(_LM, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                    num_attention_heads=4, max_position_embeddings=64, dropout=0.0,
                                                    word_embed_proj_dim=32)),
        ("bloom-fused-qkv", "BloomForCausalLM", "BloomConfig", dict(_LM, hidden_size=32, n_layer=2, n_head=4,
                                                                     hidden_dropout=0.0, attention_dropout=0.0)),
        ("falcon-fused-qkv", "FalconForCausalLM", "FalconConfig", dict(_LM, hidden_size=32, num_hidden_layers=2,
                                                                        num_attention_heads=4, new_decoder_architecture=False,
                                                                        multi_query=False, hidden_dropout=0.0,
                                                                        attention_dropout=0.0, parallel_attn=True)),
        ("gptj", "GPTJForCausalLM", "GPTJConfig", dict(_LM, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                       rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        ("mixtral-moe", "MixtralForCausalLM", "MixtralConfig", dict(_DECODER, num_key_value_heads=2,
                                                                     num_local_experts=4, num_experts_per_tok=2)),
        ("phi", "PhiForCausalLM", "PhiConfig", dict(_DECODER, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
        ("gemma2", "Gemma2ForCausalLM", "Gemma2Config", dict(_DECODER, num_key_value_heads=2, head_dim=8)),
        ("codegen", "CodeGenForCausalLM", "CodeGenConfig", dict(_LM, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                                 rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                                                 attn_pdrop=0.0)),
        ("starcoder2", "Starcoder2ForCausalLM", "Starcoder2Config", dict(_DECODER, num_key_value_heads=2,
                                                                          residual_dropout=0.0, embedding_dropout=0.0)),
        ("olmo", "OlmoForCausalLM", "OlmoConfig", dict(_DECODER, num_key_value_heads=2)),
        ("gpt-bigcode-mqa", "GPTBigCodeForCausalLM", "GPTBigCodeConfig", dict(_LM, n_embd=32, n_layer=2, n_head=4,
                                                                               n_positions=64, resid_pdrop=0.0,
                                                                               embd_pdrop=0.0, attn_pdrop=0.0)),
    ]
    models = [ZooModel(name, "causal", _hf(cls, cfg, **settings), _ids, next_token_loss)
              for name, cls, cfg, settings in causal]
    masked = [
        ("bert", "BertForMaskedLM", "BertConfig", dict(_ENCODER)),
        ("roberta", "RobertaForMaskedLM", "RobertaConfig", dict(_ENCODER, max_position_embeddings=64, pad_token_id=1)),
        ("distilbert", "DistilBertForMaskedLM", "DistilBertConfig", dict(vocab_size=VOCAB, dim=32, hidden_dim=64,
                                                                       n_layers=2, n_heads=4, dropout=0.0,
                                                                       attention_dropout=0.0)),
        ("electra", "ElectraForMaskedLM", "ElectraConfig", dict(_ENCODER, embedding_size=32)),
        ("deberta-v2", "DebertaV2ForMaskedLM", "DebertaV2Config", dict(_ENCODER)),
        ("albert-shared-layers", "AlbertForMaskedLM", "AlbertConfig", dict(_ENCODER, embedding_size=16)),
    ]
    models += [ZooModel(name, "masked", _hf(cls, cfg, **settings), _ids, same_token_loss,
                        repeated_blocks=1 if "albert" in name else 2)
               for name, cls, cfg, settings in masked]
    models += [
        ZooModel("t5", "seq2seq", _wrapped(Seq2Seq, _hf("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB,
                                                        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                                        dropout_rate=0.0, decoder_start_token_id=0)),
                 _ids, same_token_loss),
        ZooModel("bart", "seq2seq", _wrapped(Seq2Seq, _hf("BartForConditionalGeneration", "BartConfig",
                                                          vocab_size=VOCAB, d_model=32, encoder_layers=2,
                                                          decoder_layers=2, encoder_attention_heads=4,
                                                          decoder_attention_heads=4, encoder_ffn_dim=64,
                                                          decoder_ffn_dim=64, max_position_embeddings=64,
                                                          dropout=0.0, attention_dropout=0.0)),
                 _ids, same_token_loss),
        ZooModel("vit", "vision", _hf("ViTForImageClassification", "ViTConfig", **_VIT), _pixels, class_loss),
        ZooModel("deit", "vision", _hf("DeiTForImageClassification", "DeiTConfig", **_VIT), _pixels, class_loss),
        ZooModel("beit", "vision", _hf("BeitForImageClassification", "BeitConfig", **_VIT, use_mask_token=True,
                                       drop_path_rate=0.0),
                 _pixels, class_loss),
        ZooModel("swin", "vision", _hf("SwinForImageClassification", "SwinConfig", **_VISION, embed_dim=16,
                                       depths=[2, 2], num_heads=[2, 4], window_size=4, patch_size=4,
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                       drop_path_rate=0.0), _pixels, class_loss),
        ZooModel("convnext", "vision", _hf("ConvNextForImageClassification", "ConvNextConfig", **_VISION,
                                           num_stages=2, hidden_sizes=[16, 32], depths=[2, 2], drop_path_rate=0.0),
                 _pixels, class_loss),
        ZooModel("resnet", "vision", _hf("ResNetForImageClassification", "ResNetConfig", **_VISION,
                                         num_stages=2, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1]),
                 _pixels, class_loss, linear_blocks=False),
        ZooModel("wav2vec2", "audio", _hf("Wav2Vec2ForCTC", "Wav2Vec2Config", vocab_size=VOCAB, hidden_size=32,
                                          intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4),
                                          num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                                          hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                          feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
                                          mask_time_prob=0.0),
                 _waveform, ctc_like_loss),
        ZooModel("whisper", "audio", _wrapped(WhisperLike, _hf("WhisperForConditionalGeneration", "WhisperConfig",
                                                               vocab_size=VOCAB, d_model=32, encoder_layers=2,
                                                               decoder_layers=2, encoder_attention_heads=4,
                                                               decoder_attention_heads=4, encoder_ffn_dim=64,
                                                               decoder_ffn_dim=64, num_mel_bins=8,
                                                               max_source_positions=16, max_target_positions=16,
                                                               dropout=0.0, attention_dropout=0.0,
                                                               decoder_start_token_id=0, pad_token_id=0),
                                                               mels=8, frames=32),
                 lambda batch, generator: torch.randn(batch, 8 * 32, generator=generator), ctc_like_loss),
        ZooModel("plain-mha", "plain", PlainMHA, _ids, next_token_loss),
        ZooModel("plain-transformer", "plain", PlainTransformer, _ids, next_token_loss),
        ZooModel("plain-cnn", "plain", PlainCNN, _pixels, class_loss, linear_blocks=False, repeated_blocks=3),
    ]
    return models


def by_name() -> dict[str, ZooModel]:
    return {model.name: model for model in zoo()}
