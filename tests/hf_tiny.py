"""Tiny Hugging Face models built from configs (no download), as a user hands them to autopar.

Each is initialized by Hugging Face itself under a fixed seed (its weights are the init source),
with eager attention and no dropout, so one process and any plan compute the same thing.
Encoder-decoder and vision models are wrapped the way a user trains them on one tensor: an
encoder-decoder reads the token ids on both sides (teacher forcing), a vision model reads pixels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SEED = 1234
VOCAB = 96
SEQ = 16
IMAGE = 16


class EncoderDecoder(nn.Module):
    """Ids in, next-token logits out: the encoder reads the ids, the decoder the same ids."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor):
        return self.inner(input_ids=ids, decoder_input_ids=ids)


class ImageClassifier(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, pixels: torch.Tensor):
        return self.inner(pixel_values=pixels)


def build(family: str, layers: int = 4) -> nn.Module:
    """A tiny model of `family` (llama, gpt2, t5, bart, vit, bert) with `layers` blocks per stack.

    `qwen2-default` and `bart-default` keep every Hugging Face default but sizes (and dropout, off so
    that one process and a plan compute the same thing): `use_cache=True`, the default attention."""
    import transformers

    common = dict(vocab_size=VOCAB, use_cache=False, attn_implementation="eager")
    if family == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          attention_dropout=0.0, bos_token_id=0, eos_token_id=1, **common)
        make = lambda: transformers.LlamaForCausalLM(config)  # noqa: E731
    elif family == "gpt2":  # tied embedding and head, Conv1D projections, a fused QKV
        config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1, **common)
        make = lambda: transformers.GPT2LMHeadModel(config)  # noqa: E731
    elif family == "t5":  # relative position bias made by block 0 and handed down the stack; tied head
        config = transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_decoder_layers=layers,
                                       num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                                       eos_token_id=1, **common)
        make = lambda: EncoderDecoder(transformers.T5ForConditionalGeneration(config))  # noqa: E731
    elif family == "bart":
        config = transformers.BartConfig(d_model=32, encoder_layers=layers, decoder_layers=layers,
                                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                         decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
                                         attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
                                         bos_token_id=0, eos_token_id=1, decoder_start_token_id=0, **common)
        make = lambda: EncoderDecoder(transformers.BartForConditionalGeneration(config))  # noqa: E731
    elif family == "vit":
        config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                        intermediate_size=64, image_size=IMAGE, patch_size=4, num_channels=3,
                                        num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                        attn_implementation="eager")
        make = lambda: ImageClassifier(transformers.ViTForImageClassification(config))  # noqa: E731
    elif family == "bert":  # masked LM: decoder tied to the word embedding, its bias tied too
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                         intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, **common)
        make = lambda: transformers.BertForMaskedLM(config)  # noqa: E731
    elif family == "qwen2-default":  # as a user builds it: use_cache on, the default attention, untied head
        config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64)
        make = lambda: transformers.Qwen2ForCausalLM(config)  # noqa: E731
    elif family == "bart-default":  # the same for an encoder-decoder: only sizes set, dropout off for parity
        config = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=layers, decoder_layers=layers,
                                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                         decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
                                         attention_dropout=0.0, activation_dropout=0.0)
        make = lambda: EncoderDecoder(transformers.BartForConditionalGeneration(config))  # noqa: E731
    else:
        raise ValueError(f"unknown family {family!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return make()


def example_inputs(family: str, batch: int, device="meta") -> tuple[torch.Tensor, ...]:
    if family == "vit":
        return (torch.zeros(batch, 3, IMAGE, IMAGE, device=device),)
    return (torch.zeros(batch, SEQ, dtype=torch.long, device=device),)


def data(family: str, global_batch: int, steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED + 1)
    if family == "vit":
        return [torch.randn(global_batch, 3, IMAGE, IMAGE, generator=generator) for _ in range(steps)]
    return [torch.randint(0, VOCAB, (global_batch, SEQ), generator=generator) for _ in range(steps)]


def loss_fn(output, inputs: torch.Tensor) -> torch.Tensor:
    """The user's loss on the model's own output (a ModelOutput), no labels passed to the model:
    next-token cross entropy for token ids; for pixels, a class read off the image."""
    logits = output.logits.float()
    if inputs.is_floating_point():
        return F.cross_entropy(logits, inputs[:, 0, 0, :logits.shape[-1]].argmax(-1))
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), inputs[:, 1:].reshape(-1))


def heads(family: str) -> tuple[int, int]:
    """(attention heads, key-value heads) of `build(family)`."""
    return (4, 2) if family in ("llama", "qwen2-default") else (4, 4)
