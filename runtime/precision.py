"""Mixed precision: bf16/fp16 compute with fp32 master weights, optimizer states and gradient reduction."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_problem(precision: str) -> str | None:
    """Why the runtime cannot train in `precision`, or None. fp16 under autocast needs dynamic loss
    scaling: its activation gradients flush to zero below fp16's smallest subnormal (6e-8), so small
    updates are lost (PyTorch's AMP recipe pairs float16 autocast with torch.amp.GradScaler). bf16 has
    fp32's exponent range and needs none. Loss scaling is not built, so fp16 is refused rather than
    trained silently without it; plans still price fp16 (runs of other software, the published rows)."""
    if precision == "fp16":
        return ("fp16 training needs loss scaling (torch.amp.GradScaler) so that small gradients do not flush "
                "to zero, and autopar's runtime does not scale losses yet: train in bf16 (GPUs since Ampere) or "
                "fp32; `autopar plan --precision fp16` still prices fp16 runs")
    return None


def fsdp_policy(precision: str) -> MixedPrecisionPolicy | None:
    """Under FSDP2, parameters are cast at gather time and gradients reduced in fp32."""
    if precision == "fp32":
        return None
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)


def autocast(precision: str, device: torch.device, fsdp: bool):
    """Without FSDP, autocast gives low-precision matmuls over fp32 parameters."""
    if precision == "fp32" or fsdp:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])
