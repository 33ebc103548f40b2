"""The model zoo: built-in GPT and Llama families, their published sizes, and user factories.

`build_model` returns a `ModelSpec`: the module (on the meta device unless asked otherwise), the
example inputs a training step would see, and the loss to differentiate, so tracing and training
agree on what one step is.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

from autopar.errors import AutoparError
from autopar.models.config import TransformerConfig, parse_overrides
from autopar.models.gpt import GPT
from autopar.models.llama import Llama

# Published shapes. GPT-2: Radford et al. 2019, Table 2 (vocab 50,257, context 1,024).
# GPT-3: Brown et al. 2020, Table 2.1 (context 2,048); head counts follow Megatron-LM's configs
# where the paper's d_head x n_heads does not equal d_model (1.3B: 16 heads of 128).
# Mixtral 8x7B: Jiang et al. 2024 ("Mixtral of Experts"), Table 1 (dim 4096, 32 layers, 32 heads of
# 128, 8 kv heads, hidden 14336, vocab 32,000, context 32,768, 8 experts, top 2, rope theta 1e6). Mixtral
# routes dropless; the zoo's MoE pads each expert's queue, here to a capacity factor of 1.25 (Switch
# Transformer's, Fedus et al. 2022, Table 1), so its all-to-alls and expert GEMMs move 1.25x the tokens.
# Llama 3: Llama Team 2024 ("The Llama 3 Herd of Models"), Table 3 (vocab 128,256, rope theta 500,000).
_GPT2 = dict(family="gpt", vocab=50257, seq_len=1024)
_GPT3 = dict(family="gpt", vocab=50257, seq_len=2048)
_LLAMA3 = dict(family="llama", vocab=128256, seq_len=8192, kv_heads=8, rope_theta=500000.0)

PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-124m": dict(_GPT2, layers=12, hidden=768, heads=12),
    "gpt2-350m": dict(_GPT2, layers=24, hidden=1024, heads=16),
    "gpt2-774m": dict(_GPT2, layers=36, hidden=1280, heads=20),
    "gpt2-1.5b": dict(_GPT2, layers=48, hidden=1600, heads=25),
    "gpt3-1.3b": dict(_GPT3, layers=24, hidden=2048, heads=16),
    "gpt3-2.7b": dict(_GPT3, layers=32, hidden=2560, heads=32),
    "gpt3-6.7b": dict(_GPT3, layers=32, hidden=4096, heads=32),
    "gpt3-13b": dict(_GPT3, layers=40, hidden=5120, heads=40),
    "gpt3-175b": dict(_GPT3, layers=96, hidden=12288, heads=96),
    "llama3-8b": dict(_LLAMA3, layers=32, hidden=4096, heads=32, ffn_hidden=14336),
    "llama3-70b": dict(_LLAMA3, layers=80, hidden=8192, heads=64, ffn_hidden=28672),
    "llama3-405b": dict(_LLAMA3, layers=126, hidden=16384, heads=128, ffn_hidden=53248),
    "mixtral-8x7b": dict(family="llama", vocab=32000, seq_len=32768, layers=32, hidden=4096, heads=32, kv_heads=8,
                         ffn_hidden=14336, rope_theta=1e6, moe_experts=8, moe_top_k=2, moe_capacity_factor=1.25),
}

FAMILIES: dict[str, type[nn.Module]] = {"gpt": GPT, "llama": Llama}


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy: position t predicts token t+1 (fp32 before the reshape: one copy of the
    shifted logits, not two)."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), input_ids[:, 1:].reshape(-1))


@dataclass
class ModelSpec:
    """A built model plus what one training step feeds it."""

    name: str
    module: nn.Module
    config: TransformerConfig | None
    make_inputs: Callable[[int, int, torch.device | str], tuple[torch.Tensor, ...]]
    loss_fn: Callable[..., torch.Tensor] | None
    default_seq_len: int
    extra: dict[str, Any] = field(default_factory=dict)
    vocab: int | None = None  # the range integer inputs are drawn from (token ids), where the model states it

    def example_inputs(self, batch: int, seq_len: int | None = None, device: torch.device | str = "meta"):
        if seq_len is not None and seq_len < 1:
            raise AutoparError(f"sequence length must be at least 1, got {seq_len}: give a positive --seq-len, or "
                               f"leave it out for the model's default ({self.default_seq_len})")
        seq = self.default_seq_len if seq_len is None else seq_len
        if self.config is not None and seq > self.config.seq_len:
            raise AutoparError(
                f"sequence length {seq} exceeds {self.name}'s maximum of {self.config.seq_len}: "
                f"lower --seq-len or raise it with --model-config seq_len={seq}"
            )
        if batch <= 0:
            raise AutoparError(f"batch must be positive, got {batch}")
        return self.make_inputs(batch, seq, device)


def list_models() -> list[str]:
    return sorted(PRESETS) + sorted(FAMILIES)


def zoo_config(name: str, overrides: dict[str, Any] | None = None) -> TransformerConfig:
    """The TransformerConfig of a preset or family name, with overrides applied."""
    if name in PRESETS:
        base = dict(PRESETS[name])
    elif name in FAMILIES:
        base = {"family": name}
    else:
        raise AutoparError(
            f"unknown model {name!r}: use one of {', '.join(list_models())}, or package.module:factory"
        )
    base.update(overrides or {})
    try:
        return TransformerConfig(**base)
    except ValidationError as error:
        raise AutoparError(f"bad config for model {name!r}: {_one_line(error)}") from None


def build_model(
    name: str,
    overrides: dict[str, Any] | str | None = None,
    device: torch.device | str = "meta",
    seed: int | None = None,
) -> ModelSpec:
    """Build a zoo model or a user factory (`package.module:factory`) on `device` (meta by default)."""
    if isinstance(overrides, str):
        overrides = parse_overrides(overrides)
    overrides = dict(overrides or {})
    if seed is not None:
        torch.manual_seed(seed)
    if ":" in name:
        return _build_factory(name, overrides, device)
    config = zoo_config(name, overrides)
    with torch.device(device):
        module = FAMILIES[config.family](config)
    return ModelSpec(
        name=name,
        module=module,
        config=config,
        make_inputs=lambda batch, seq, dev: (
            torch.randint(0, config.vocab, (batch, seq), device=dev) if str(dev) != "meta"
            else torch.empty((batch, seq), dtype=torch.long, device=dev),
        ),
        loss_fn=lm_loss,
        default_seq_len=config.seq_len,
        vocab=config.vocab,
    )


def _build_factory(target: str, overrides: dict[str, Any], device: torch.device | str) -> ModelSpec:
    """A user's `package.module:factory`. Whatever its code raises (at import, or while building) becomes
    one line naming the factory and the error; `--debug` shows the traceback (chained as the cause)."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise AutoparError(f"model {target!r} is not package.module:factory: name a module and a function in it")
    try:
        module_object = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name or module_name.startswith(f"{error.name}."):  # the module itself is missing
            raise AutoparError(f"cannot import {module_name!r} for model {target!r} ({error}): check the module path "
                               f"and PYTHONPATH") from error
        raise factory_error(target, f"importing {module_name!r}", error) from error
    except (Exception, SystemExit) as error:  # a syntax error, or whatever the module raises at import
        raise factory_error(target, f"importing {module_name!r}", error) from error
    factory = getattr(module_object, attr, None)
    if factory is None:
        raise AutoparError(f"module {module_name!r} has no {attr!r}: name a factory function as package.module:factory")
    if not callable(factory):
        raise AutoparError(f"{target!r} is not callable (it is {type(factory).__name__}): name a factory function")
    try:
        with torch.device(device):
            module = factory(**overrides)
    except TypeError as error:
        raise AutoparError(f"factory {target!r} rejected its arguments ({_error_text(error)}): check --model-config "
                           f"keys (--debug shows the traceback)") from error
    except (Exception, SystemExit) as error:
        raise factory_error(target, "building the model", error) from error
    if not isinstance(module, nn.Module):
        raise AutoparError(f"factory {target!r} returned {type(module).__name__}, not an nn.Module")
    try:
        default_seq_len = int(getattr(module, "default_seq_len", 128))
    except (TypeError, ValueError):
        raise AutoparError(f"factory {target!r} built a model whose default_seq_len "
                           f"{getattr(module, 'default_seq_len')!r} is not a whole number: fix the model") from None
    if default_seq_len < 1:
        raise AutoparError(f"factory {target!r} built a model whose default_seq_len is {default_seq_len}: give it a "
                           f"positive sequence length")
    return ModelSpec(
        name=target,
        module=module,
        config=None,
        make_inputs=_factory_inputs(target, module),
        loss_fn=getattr(module, "loss", None),
        default_seq_len=default_seq_len,
        vocab=_factory_vocab(module),
    )


def _factory_vocab(module: nn.Module) -> int | None:
    """The vocabulary a factory model states: a Hugging Face `config.vocab_size`, or its own `vocab_size`."""
    for value in (getattr(getattr(module, "config", None), "vocab_size", None), getattr(module, "vocab_size", None)):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _error_text(error: BaseException) -> str:
    """`Kind: message` on one line; a syntax error also says where."""
    from autopar.validation import one_line

    if isinstance(error, SyntaxError) and error.filename:
        return one_line(f"SyntaxError: {error.msg} ({error.filename}, line {error.lineno})", 200)
    message = one_line(str(error), 200)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def factory_error(target: str, doing: str, error: BaseException) -> AutoparError:
    return AutoparError(f"factory {target!r} failed while {doing}: {_error_text(error)}; fix the factory's code "
                        f"(--debug shows the traceback)")


def _factory_inputs(target: str, module: nn.Module):
    if callable(getattr(module, "example_inputs", None)):
        def example(batch: int, seq: int, dev: Any) -> tuple[torch.Tensor, ...]:
            try:
                return tuple(module.example_inputs(batch, seq, dev))
            except AutoparError:
                raise
            except (Exception, SystemExit) as error:
                raise factory_error(target, "making example inputs (its example_inputs method)", error) from error

        return example
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    if vocab is not None:  # a Hugging Face style language model: token ids in, logits out
        return lambda batch, seq, dev: (
            torch.randint(0, vocab, (batch, seq), device=dev) if str(dev) != "meta"
            else torch.empty((batch, seq), dtype=torch.long, device=dev),
        )

    def missing(batch: int, seq: int, dev: Any) -> tuple[torch.Tensor, ...]:
        raise AutoparError(
            f"cannot tell what inputs {target!r} takes: give the module an example_inputs(batch, seq_len, device) method"
        )

    return missing


def _one_line(error: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in item['loc']) or 'config'}: {item['msg']}" for item in error.errors()
    )
