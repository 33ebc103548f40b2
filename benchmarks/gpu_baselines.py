"""Hand-written PyTorch baselines that `gpu_suite.py` holds autopar's runtime against.

- `plain_step`: the zoo model as a plain module, as a user writes the loop: autocast, loss, backward,
  clip, AdamW with torch's defaults (foreach); eager or `torch.compile(model)`. `vocab_multiple=1`
  builds it as a user would, with the vocabulary unpadded.
- `ReferenceGPT` / `reference_step`: a GPT written the way the fastest single-GPU scripts write it
  (one fused QKV projection, the head tied to a vocabulary padded to 50,304, flash attention through
  scaled_dot_product_attention, fused AdamW), our own code; eager or compiled. It is the anchor of the
  MFU goal (a script of this kind reached 54.6% compiled on an H100: ../shared/gpu).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models import build_model

LR = 1e-4
MAX_GRAD_NORM = 1.0
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def plain_step(model_name: str, model_config: str | None, batch: int, seq_len: int, precision: str,
               compiled: bool, device: str = "cuda"):
    """The step function of the zoo model in a plain training loop on `device`."""
    from autopar.runtime.init import InitSource, materialize

    spec = build_model(model_name, model_config)
    model = copy.deepcopy(spec.module)
    materialize(model, InitSource(spec.module, 0), torch.device(device))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR)
    forward = torch.compile(model) if compiled else model
    ids = torch.randint(0, spec.config.vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    dtype = DTYPES[precision]

    def step() -> float:
        with torch.autocast(device_type=device, dtype=dtype, enabled=precision != "fp32"):
            loss = spec.loss_fn(forward(ids), ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, hidden // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class ReferenceGPT(nn.Module):
    """GPT with a padded, tied vocabulary and fused QKV: the hand-tuned single-GPU anchor."""

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(param, std=std)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def reference_step(layers: int, hidden: int, heads: int, batch: int, seq_len: int, compiled: bool,
                   vocab: int = 50304, real_vocab: int = 50257, device: str = "cuda"):
    """The step function of ReferenceGPT in bf16 autocast with fused AdamW."""
    with torch.device(device):
        model = ReferenceGPT(layers, hidden, heads, vocab, seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=device == "cuda")
    forward = torch.compile(model) if compiled else model
    data = torch.randint(0, real_vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0)).to(device)
    ids, targets = data[:, :-1], data[:, 1:]

    def step() -> float:
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = forward(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step
