"""Mixed precision: bf16/fp16 compute with fp32 master weights, optimizer states and gradient reduction
(fp16 with a dynamic loss scale: `runtime.loss_scaling`)."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
