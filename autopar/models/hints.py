"""What a model's config says about its shape, read off a zoo or Hugging Face model.

The searcher offers only tp degrees that divide the heads (autopar/api.py), and a plan is checked
against the same numbers before it runs (autopar/plan_checks.py).
"""

from __future__ import annotations

from torch import nn


def model_hints(module: nn.Module) -> dict[str, int | None]:
    """Attention heads, key/value heads and vocabulary (the head's width: padded, for the zoo) of a zoo
    or Hugging Face model, read off its config (None where it has none): the tp degrees the searcher
    may offer must divide the heads."""
    config = getattr(module, "config", None)

    def first(*names: str) -> int | None:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    heads = first("heads", "num_attention_heads", "n_head", "num_heads")
    return {"heads": heads, "kv_heads": first("num_kv_heads", "num_key_value_heads") or heads,
            "vocab": first("padded_vocab", "vocab", "vocab_size")}
