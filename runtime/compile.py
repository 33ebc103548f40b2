"""Per-block torch.compile: each transformer block's forward, after everything that wraps it.

Why per block and why the forward only: every block of a model runs the same code, so the compiled
graph is shared and compile time does not grow with depth; a whole-model graph would also have to
swallow the embedding, the head and the pipeline's stage cuts. Replacing the instance's `forward`
(not the module, not `__call__`) keeps parameter names unchanged (plans, checkpoints and placements
keep working) and leaves the module hooks of FSDP2 outside the compiled code, running eagerly
around it; the recompute wrapper, when there is one, is the forward that gets compiled, so the
checkpoint region is traced as one unit. Pipeline stages compile the blocks they hold, the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.errors import AutoparError

# Blocks share one compiled graph when their guards agree (seen: 12 zoo GPT blocks, with and without
# recompute, one graph). Blocks that differ (say, per-layer attention windows) need an entry each:
# past dynamo's default of 8 the rest would silently run eagerly.
_MIN_CACHE_ENTRIES = 64


def compile_blocks(module: nn.Module, block_paths: list[str], *, backend: str = "inductor") -> list[str]:
    """Compile the forward of each listed block present in `module`; returns the paths compiled."""
    present = dict(module.named_modules())
    done = []
    for path in block_paths:
        block = present.get(path)
        if block is None:
            continue
        if getattr(block.forward, "_autopar_compiled", False):
            raise AutoparError(f"block {path} is already compiled: parallelize a fresh model")
        compiled = torch.compile(block.forward, backend=backend)
        compiled._autopar_compiled = True
        block.forward = compiled
        done.append(path)
    if done:
        config = torch._dynamo.config
        key = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # the newer name
        setattr(config, key, max(getattr(config, key), _MIN_CACHE_ENTRIES, 2 * len(done)))
    return done
