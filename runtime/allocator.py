"""The CUDA caching allocator's setting for training: expandable segments.

Without them the allocator carves tensors out of fixed segments and keeps what it freed, so a step
that allocates and frees blocks of many sizes (a layer's activations under full recompute, FSDP2's
gathered weights, the offloaded optimizer's copies) reserves far more than its tensors hold: on the
lent H100 `max_memory_reserved` was 6.4 GB above `max_memory_allocated` for GPT-1.3B with full
recompute, and 3.6 GB (56%) above it for GPT-2.7B with optimizer offload
(benchmarks/gpu_runs/h100-2026-11-26-2fef514.json). Expandable segments grow one mapping per
stream instead (PyTorch's CUDA semantics notes, "Optimizing memory usage with
PYTORCH_CUDA_ALLOC_CONF"). Measured with autopar on a lent H200 (7f4beee): GPT-1.3B with full
recompute reserved 29.8 GiB under them against 34.2 GiB without. A setting the user gave in
`PYTORCH_CUDA_ALLOC_CONF` or `PYTORCH_ALLOC_CONF` is left as it is, and the run says when it drops
what the plan's memory was priced for.
"""

from __future__ import annotations

import os

import torch

SETTING = "expandable_segments:True"
USER_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# The memory model prices expandable segments (`cost_models.memory`); the default allocator reserved more
# around the same tensors on the lent GPUs (`python benchmarks/gpu_rows.py`), so a run without them says so.
PRICED_FOR = "; the plan's memory was priced for expandable segments: this allocator may reserve more"


def configure_allocator(device: torch.device) -> str:
    """Turn expandable segments on for `device` when it is a CUDA device and the user set nothing;
    returns what was done, in a few words (`autopar run` prints it)."""
    if device.type != "cuda":
        return "not applied (not a CUDA device)"
    given = next((name for name in USER_SETTINGS if os.environ.get(name)), None)
    if given is not None:
        setting = os.environ[given]
        expandable = "expandable_segments:true" in setting.replace(" ", "").lower()
        return f"as the user set it ({given}={setting})" + ("" if expandable else PRICED_FOR)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    try:
        if setter is not None:
            setter(SETTING)
        else:
            torch.cuda.memory._set_allocator_settings(SETTING)
    except Exception as error:  # a platform or torch without them: the default allocator, said so
        return f"default (expandable segments unavailable: {str(error).splitlines()[0]})" + PRICED_FOR
    return "expandable segments"


def expandable_in_effect(note: str) -> bool:
    """Whether a run's allocator note (`configure_allocator`'s words) means expandable segments were on:
    what the memory model prices. Files before the runtime set them record no note: the default."""
    if note == "expandable segments":
        return True
    return note.startswith("as the user set it") and "expandable_segments:true" in note.replace(" ", "").lower()
