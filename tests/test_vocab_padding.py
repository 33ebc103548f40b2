"""Padded vocabularies (issue #29): the head's GEMM gets a width the fast kernels take, and nothing a
user sees changes: the loss and every real row's gradient equal the unpadded model's."""

from __future__ import annotations

import pytest
import torch

from autopar.models import build_model, lm_loss, zoo_config

CONFIG = "layers=2,hidden=32,heads=4,kv_heads=2,vocab=97,seq_len=16"


def test_padded_vocab_rounds_up_to_the_multiple():
    assert zoo_config("gpt3-1.3b").padded_vocab == 50304  # Megatron-LM's padded GPT-2 vocabulary
    assert zoo_config("llama3-8b").padded_vocab == 128256  # already a multiple of 128: unchanged
    assert zoo_config("gpt", {"vocab": 97}).padded_vocab == 128
    assert zoo_config("gpt", {"vocab": 97, "vocab_multiple": 1}).padded_vocab == 97


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_padding_leaves_loss_and_gradients_unchanged(family):
    padded = build_model(family, CONFIG, device="cpu", seed=0).module
    plain = build_model(family, CONFIG + ",vocab_multiple=1", device="cpu", seed=0).module
    assert padded.head.weight.shape[0] == 128 and plain.head.weight.shape[0] == 97
    with torch.no_grad():  # the same real weights in both
        for (name, p), q in zip(padded.named_parameters(), plain.parameters()):
            p[: q.shape[0]].copy_(q) if p.shape != q.shape else p.copy_(q)
    ids = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(1))
    logits = padded(ids)
    assert torch.isneginf(logits[..., 97:]).all() and torch.isfinite(logits[..., :97]).all()
    padded_loss, plain_loss = lm_loss(logits, ids), lm_loss(plain(ids), ids)
    torch.testing.assert_close(padded_loss, plain_loss, rtol=1e-6, atol=0)
    padded_loss.backward()
    plain_loss.backward()
    for (name, p), q in zip(padded.named_parameters(), plain.parameters()):
        real = p.grad[: q.shape[0]] if p.shape != q.shape else p.grad
        torch.testing.assert_close(real, q.grad, rtol=1e-5, atol=1e-7, msg=name)
        if p.shape != q.shape:  # the padded rows never reach the loss
            assert torch.count_nonzero(p.grad[q.shape[0]:]) == 0, name
