"""A deep block stack captured from a shallow twin (`autopar.graph.repeats`) is exactly the full trace.

Each test traces a model twice, with the shortcut (the default) and with `expand_repeats=False`
(every block traced), and compares every field of every node and of the graph. Where the shortcut
must not be taken, the capture says why in its debug log and still gives the full trace.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import autopar
from autopar.graph import trace
from autopar.graph.capture import trace_with_twins
from autopar.graph.repeats import MIN_BLOCKS, expand_nodes, find_block_stack
from autopar.models import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

FELL_BACK = "tracing every block"


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _both(model, inputs, **options):
    """(graph with the shortcut, graph of the full trace, why the shortcut was not taken or None)."""
    logger, said = logging.getLogger("autopar.graph.capture"), _Said()
    level = logger.level
    logger.addHandler(said)
    logger.setLevel(logging.DEBUG)
    try:
        fast = trace(model, inputs, **options)
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
    reasons = [message for message in said.messages if FELL_BACK in message]
    full = trace(model, inputs, expand_repeats=False, **options)
    return fast, full, reasons[0] if reasons else None


def _assert_same_graph(fast, full):
    assert len(fast.nodes) == len(full.nodes)
    for expanded, traced in zip(fast.nodes, full.nodes):  # the first differing node, if any, reads best
        assert expanded.model_dump() == traced.model_dump()
    assert fast.model_dump() == full.model_dump()


@pytest.mark.parametrize("family,config", [
    ("gpt", "layers=8,hidden=64,heads=4,vocab=128,seq_len=32"),
    ("llama", "layers=8,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,vocab=128,seq_len=32"),
])
def test_zoo_models_expand_to_exactly_the_full_trace(family, config):
    spec = build_model(family, config)
    fast, full, fell_back = _both(spec.module, spec.example_inputs(2), loss_fn=spec.loss_fn,
                                  precision="bf16")
    assert fell_back is None  # the shortcut was taken...
    _assert_same_graph(fast, full)  # ...and gave the full trace
    assert fast.layer_types[0].instances == [f"layers.{i}" for i in range(8)]


def _hugging_face(name: str, layers: int) -> nn.Module:
    """A causal LM of benchmarks/zoo_models.py (Hugging Face's defaults: use_cache on, the default
    attention; sizes tiny) with `layers` blocks."""
    import zoo_models

    settings = {"llama": dict(zoo_models._DECODER, num_key_value_heads=2, num_hidden_layers=layers),
                "qwen2": dict(zoo_models._DECODER, num_key_value_heads=2, num_hidden_layers=layers),
                "gpt2": dict(zoo_models._LM, n_embd=32, n_layer=layers, n_head=4, n_positions=64, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0),
                "gemma2": dict(zoo_models._DECODER, num_key_value_heads=2, head_dim=8, num_hidden_layers=layers)}
    classes = {"llama": ("LlamaForCausalLM", "LlamaConfig"), "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
               "gpt2": ("GPT2LMHeadModel", "GPT2Config"), "gemma2": ("Gemma2ForCausalLM", "Gemma2Config")}
    torch.manual_seed(0)
    return zoo_models._hf(*classes[name], **settings[name])()


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_hugging_face_causal_lms_expand_to_exactly_the_full_trace(name):
    import zoo_models

    model = _hugging_face(name, 8)
    fast, full, fell_back = _both(model, torch.zeros(2, 16, dtype=torch.long, device="meta"),
                                  loss_fn=zoo_models.next_token_loss, precision="bf16")
    assert fell_back is None
    _assert_same_graph(fast, full)


def test_per_layer_attention_types_take_the_full_trace():
    """Gemma 2 alternates sliding and full attention by layer (its blocks store which)."""
    import zoo_models

    model = _hugging_face("gemma2", 8)
    fast, full, fell_back = _both(model, torch.zeros(2, 16, dtype=torch.long, device="meta"),
                                  loss_fn=zoo_models.next_token_loss, precision="bf16")
    assert fell_back is not None and "layer_type" in fell_back
    _assert_same_graph(fast, full)


class Block(nn.Module):
    def __init__(self, index: int, width: int = 16, extra: bool = False) -> None:
        super().__init__()
        self.index = index
        self.proj = nn.Linear(width, width)
        self.extra = nn.Linear(width, width) if extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.proj(x))
        return x + self.extra(x) if self.extra is not None else x


class EveryThirdBlockScales(Block):
    """Its forward branches on the stored layer index: blocks 2, 5, 8 run one more op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return x * 2 if self.index % 3 == 2 else x


class FlaggedBlock(Block):
    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.doubles = index % 2 == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return x * 2 if self.doubles else x


class SharedInputBlock(Block):
    def forward(self, x: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * shared


class SharedParameter(nn.Module):
    """Every block reads one trainable parameter: the last block's backward (the first to run) holds
    no gradient accumulation, the others add to the running sum, so no block is a template for all."""

    def __init__(self, blocks: int = 10) -> None:
        super().__init__()
        self.shared = nn.Parameter(torch.ones(16))
        self.layers = nn.ModuleList(SharedInputBlock(i) for i in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, self.shared)
        return x


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], by_count: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.count = len(blocks) if by_count else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.count is not None:  # indexes its blocks by a count of its own
            for i in range(self.count):
                x = self.layers[i](x)
            return x
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("model,why", [
    (Stack([EveryThirdBlockScales(i) for i in range(10)]), "differs from blocks 0, N/2, N-2, N-1 traced"),
    (Stack([FlaggedBlock(i) for i in range(10)]), "blocks differ in :doubles"),
    (Stack([Block(i * 2) for i in range(10)]), "neither constant nor the layer index"),
    (Stack([Block(i, extra=i == 6) for i in range(10)]), "0 stacks"),
    (Stack([Block(i) for i in range(MIN_BLOCKS - 1)]), "0 stacks"),
    (Stack([Block(i) for i in range(10)], by_count=True), "the twin's trace failed"),
    (SharedParameter(), "a value shared by every block?"),
], ids=["branches-on-index", "per-layer-flag", "non-index-int", "non-uniform", "short", "indexed-by-count",
        "shared-parameter"])
def test_models_the_shortcut_cannot_serve_get_the_full_trace(model, why):
    fast, full, fell_back = _both(model, torch.zeros(2, 16, device="meta"))
    assert fell_back is not None and why in fell_back
    _assert_same_graph(fast, full)


def test_a_uniform_stack_that_stores_its_index_takes_the_shortcut():
    """The control for the models above: an integer layer index alone does not stop the shortcut."""
    fast, full, fell_back = _both(Stack([Block(i) for i in range(10)]), torch.zeros(2, 16, device="meta"))
    assert fell_back is None
    _assert_same_graph(fast, full)


def test_the_twin_leaves_the_model_untouched():
    model = Stack([Block(i) for i in range(10)])
    before = [(name, id(module)) for name, module in model.named_modules()]
    trace(model, torch.zeros(2, 16, device="meta"))
    assert [(name, id(module)) for name, module in model.named_modules()] == before
    assert find_block_stack(model) == ("layers", 10)


def test_expansion_refuses_ops_between_blocks():
    """A node list whose blocks interleave has no block to repeat: it is refused, not mis-expanded."""
    spec = build_model("gpt", "layers=3,hidden=32,heads=4,vocab=96,seq_len=16")
    nodes = trace(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn).nodes
    first_of_block_1 = next(i for i, n in enumerate(nodes) if n.module_path.startswith("layers.1"))
    nodes.insert(first_of_block_1, nodes[0].model_copy(update={"name": "between", "module_path": ""}))
    from autopar.graph.repeats import NotExpandable

    with pytest.raises(NotExpandable, match="ops run between blocks 0 and 1"):
        expand_nodes(nodes, "layers", 3, 8)


def test_plan_of_a_deep_model_is_the_plan_of_its_full_trace(monkeypatch, tmp_path):
    """`autopar.plan` from the expanded graph chooses and prices exactly what the full trace gives (the
    runtime probes, which do not read the graph, answer the second plan from the first's cache)."""
    from autopar import api

    spec = build_model("gpt", "layers=12,hidden=256,heads=8,vocab=1024,seq_len=128")

    def plan():
        return autopar.plan(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, global_batch=16,
                            cluster=autopar.load_cluster("dgx-a100-80gb", gpus=8), seq_len=128, use_ilp=False,
                            probe_cache=tmp_path)

    expanded = plan()
    monkeypatch.setattr(api, "trace_with_twins", lambda *a, **k: trace_with_twins(*a, expand_repeats=False, **k))
    full = plan()
    assert expanded.graph == full.graph
    assert expanded.plan is not None
    assert expanded.plan.model_dump(exclude={"provenance"}) == full.plan.model_dump(exclude={"provenance"})
    timing = {"plan": {"provenance"}, "search": {"seconds", "ilp_solve_s"},  # clocks of each run, and what
              "checkpoint": {"hash_bytes_per_s", "save_time_s", "interval_s", "checkpoint_every"}}  # sha256 measures
    assert expanded.summary().model_dump(exclude=timing) == full.summary().model_dump(exclude=timing)
