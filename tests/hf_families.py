"""Tiny Hugging Face models of several families, built from configs (no download), for tp tests.

Each family gives a model initialized by HF itself under a seed (eager attention, no dropout),
the one tensor its forward takes in training (token ids, or pixels for ViT), and its loss
`loss(output, input)`. Encoder-decoder models are wrapped so that one tensor drives them (the
decoder reads the ids shifted right, as teacher forcing does).
"""

from __future__ import annotations

import torch
from torch import nn

SEED = 1234
VOCAB = 96
ODD_VOCAB = 97
SEQ = 16
IMAGE = (3, 16, 16)


class Seq2SeqLM(nn.Module):
    """An encoder-decoder LM driven by one tensor of ids: the decoder reads them shifted right."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor):
        decoder_ids = torch.cat([torch.zeros_like(ids[:, :1]), ids[:, :-1]], dim=1)
        return self.model(input_ids=ids, decoder_input_ids=decoder_ids)


class AttentionLM(nn.Module):
    """A plain-torch LM around nn.MultiheadAttention (which DTensor cannot shard per head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        attended, _ = self.attn(h, h, h, need_weights=False)
        return self.head(self.norm(h + attended))


class OddEncoder(nn.Module):
    """Layouts the module rules refused: a 2-D parameter no matmul reads (a learned start token), a
    block whose output projection is registered before its fused input projection, which the forward
    splits after reshaping with the configured head count, and no LM head (the last Linear is an MLP's)."""

    def __init__(self, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, hidden)
        self.start = nn.Parameter(torch.randn(1, hidden) * 0.02)
        self.out_proj = nn.Linear(hidden, hidden)
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, ids):
        batch, seq = ids.shape
        h = torch.cat([self.start.expand(batch, 1, -1), self.embed(ids[:, 1:])], dim=1)
        q, k, v = self.qkv_proj(h).view(batch, seq, self.heads, -1).transpose(1, 2).chunk(3, dim=-1)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.out_proj(attended.transpose(1, 2).reshape(batch, seq, -1))
        return h + self.down(nn.functional.gelu(self.up(self.norm(h))))


def build(family: str) -> nn.Module:
    if family == "torch_odd":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            return OddEncoder()
    if family == "torch_mha":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            return AttentionLM()
    import transformers

    common = dict(vocab_size=VOCAB, use_cache=False, attn_implementation="eager", bos_token_id=0, eos_token_id=1,
                  pad_token_id=0)
    if family in ("gpt2", "gpt2_vocab97"):  # fused QKV in a Conv1D, split after the projection; tied head
        if family == "gpt2_vocab97":  # a vocabulary tp does not divide (as GPT-2's 50257)
            common["vocab_size"] = ODD_VOCAB
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, **common)
        cls = transformers.GPT2LMHeadModel
    elif family == "gpt_neox":  # fused QKV Linear, split per head after a head-count view
        config = transformers.GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=64, max_position_embeddings=64, hidden_dropout=0.0,
                                            attention_dropout=0.0, **common)
        cls = transformers.GPTNeoXForCausalLM
    elif family == "bert":  # masked LM: decoder weight tied to the embedding, decoder bias tied too
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, **common)
        cls = transformers.BertForMaskedLM
    elif family == "t5":  # encoder-decoder, relative position bias tables no matmul reads
        config = transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                                       dropout_rate=0.0, decoder_start_token_id=0, **common)
        cls = transformers.T5ForConditionalGeneration
    elif family == "bart":
        config = transformers.BartConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                         decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                         max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                         activation_dropout=0.0, **common)
        cls = transformers.BartForConditionalGeneration
    elif family == "vit":  # a convolution before the Linears; a CLS token no matmul reads
        config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, image_size=IMAGE[1], patch_size=4,
                                        num_channels=IMAGE[0], num_labels=10, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0, attn_implementation="eager")
        cls = transformers.ViTForImageClassification
    else:
        raise ValueError(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = cls(config)
    return Seq2SeqLM(model) if family in ("t5", "bart") else model


def example_input(family: str, batch: int = 1, device: str = "meta") -> torch.Tensor:
    if family == "vit":
        return torch.zeros(batch, *IMAGE, device=device)
    return torch.zeros(batch, SEQ, dtype=torch.long, device=device)


def batches(family: str, global_batch: int, steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED + 1)
    if family == "vit":
        return [torch.randn(global_batch, *IMAGE, generator=generator) for _ in range(steps)]
    return [torch.randint(0, vocab_of(family), (global_batch, SEQ), generator=generator) for _ in range(steps)]


def vocab_of(family: str) -> int:
    return ODD_VOCAB if family == "gpt2_vocab97" else VOCAB


def causal_lm_loss(output, ids: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    vocab = logits.shape[-1]
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), ids[:, 1:].reshape(-1))


def masked_lm_loss(output, ids: torch.Tensor) -> torch.Tensor:
    """Every position predicts its own token (no masking: the data is random, the graph is the point)."""
    logits = output.logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids.reshape(-1))


def image_loss(output, pixels: torch.Tensor) -> torch.Tensor:
    """Ten classes from the mean of each image's first rows: a target the pixels determine."""
    target = (pixels[:, 0, :4].mean(dim=(1, 2)) * 20).long().clamp(-5, 4) + 5
    return nn.functional.cross_entropy(output.logits.float(), target)


def logits_loss(logits, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def regression_loss(hidden, ids: torch.Tensor) -> torch.Tensor:
    """No head: the hidden states regress onto a fixed code of each token."""
    code = torch.sin(ids.unsqueeze(-1).float() * torch.arange(1, hidden.shape[-1] + 1, dtype=torch.float32, device=ids.device) / 7)
    return nn.functional.mse_loss(hidden.float(), code)


LOSSES = {"gpt2": causal_lm_loss, "gpt2_vocab97": causal_lm_loss, "gpt_neox": causal_lm_loss, "bert": masked_lm_loss, "t5": causal_lm_loss,
          "bart": causal_lm_loss, "vit": image_loss, "torch_mha": logits_loss,
          "torch_odd": regression_loss}


def loss_for(family: str):
    return LOSSES[family]
