"""The gradient norm's reduction (`autopar.gradient_norm`): the same sum of squares as torch's foreach
norm, on host tensors split into rows so the kernel can spread them over threads."""

from __future__ import annotations

import pytest
import torch

from autopar import gradient_norm
from autopar.gradient_norm import HOST_ROW_ELEMENTS, squares_sum


def test_the_host_sum_of_squares_is_the_foreach_norms():
    torch.manual_seed(0)
    tensors = [torch.randn(7),  # under one row: the tail alone
               torch.randn(HOST_ROW_ELEMENTS),  # one row exactly
               torch.randn(3 * HOST_ROW_ELEMENTS + 11, dtype=torch.float64) * 3,  # rows and a tail
               torch.randn(300, 400).t(),  # not contiguous
               torch.randn(2 * HOST_ROW_ELEMENTS, dtype=torch.bfloat16)]  # accumulated in fp32
    expected = sum(float(torch.linalg.vector_norm(t.double())) ** 2 for t in tensors)
    ours = squares_sum(tensors)
    assert ours.dtype == torch.float32 and ours.dim() == 0
    assert float(ours) == pytest.approx(expected, rel=1e-5)
    wide = tensors[:4]  # foreach's norm of a bf16 tensor is rounded to bf16; ours accumulates in fp32
    foreach = float(torch.stack(torch._foreach_norm(wide, 2.0)).double().pow(2).sum())
    assert float(squares_sum(wide)) == pytest.approx(foreach, rel=1e-6)


def test_a_whole_tensor_is_reduced_by_rows_on_the_host(monkeypatch):
    """What makes it parallel: each host tensor of several rows is one 2-D norm over its rows."""
    calls = []
    original = torch.linalg.vector_norm

    def recording(tensor, *args, **kwargs):
        calls.append((tuple(tensor.shape), kwargs.get("dim")))
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "vector_norm", recording)
    assert float(squares_sum([torch.ones(5 * HOST_ROW_ELEMENTS + 3)])) == 5 * HOST_ROW_ELEMENTS + 3
    assert calls == [((5, HOST_ROW_ELEMENTS), 1), ((3,), None)]
    calls.clear()  # in blocks of rows, so a 16-bit tensor's fp32 copy stays a block's
    monkeypatch.setattr(gradient_norm, "HOST_BLOCK_ROWS", 2)
    squares_sum([torch.ones(5 * HOST_ROW_ELEMENTS, dtype=torch.bfloat16)])
    assert calls == [((2, HOST_ROW_ELEMENTS), 1), ((2, HOST_ROW_ELEMENTS), 1), ((1, HOST_ROW_ELEMENTS), 1)]
    calls.clear()  # not contiguous: reduced whole, not copied
    squares_sum([torch.ones(512, 512).t()])
    assert calls == [((512, 512), None)]
    with pytest.raises(ValueError):
        squares_sum([])
