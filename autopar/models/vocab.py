"""Padded vocabularies: the rows past the real vocabulary never reach the loss.

The embedding and the head hold `TransformerConfig.padded_vocab` rows so that the head's GEMM has a
width the fast kernels take; token ids never index the padded rows, and their logits are set to
-inf, so the softmax gives them probability 0: the loss, and the gradient of every real row, are the
unpadded model's (their own gradient is 0).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate


def mask_padded_logits(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits over a padded vocabulary (last dimension) with the padded columns at -inf.

    A vocabulary-parallel head gives a DTensor sharded on that dimension: the column mask is then a
    replicated DTensor (the backward keeps it), which each rank slices to its own columns (no
    communication)."""
    padded = logits.shape[-1]
    if padded == vocab:
        return logits
    padding = torch.arange(padded, device=logits.device) >= vocab
    if isinstance(logits, DTensor):
        mesh = logits.device_mesh
        padding = DTensor.from_local(padding, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return logits.masked_fill(padding, float("-inf"))
