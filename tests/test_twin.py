"""Shallow twins (`autopar.graph.twin`): planning's probes asked of a model cut to two and three
blocks answer what the whole model answers, and the whole model is asked when the twins disagree."""

from __future__ import annotations

import pytest
from torch import nn

import autopar.planning_probes as probes
import autopar.graph.twin as twin
from autopar.cluster import load_cluster
from autopar.cost_models.facts import model_facts
from autopar.graph import trace
from autopar.graph.capture import trace_with_twins
from autopar.graph.twin import block_stack, shallow_twin, twin_answer
from autopar.models import build_model
from autopar.models.hints import model_hints

from hf_tiny import build as build_hf, example_inputs as hf_inputs, loss_fn as hf_loss

DEEP_GPT = "layers=10,hidden=32,heads=4,vocab=96,seq_len=16"


def _never_remember(_kind, compute, **_arguments):
    return compute()


def test_a_twin_cuts_the_stack_and_leaves_the_model_alone():
    model = build_model("gpt", DEEP_GPT).module
    short = shallow_twin(model, 3)
    assert type(short) is type(model) and list(short.layers) == ["0", "1", "2"]
    assert short.layers["2"] is model.layers["2"] and short.embed.weight is model.embed.weight
    assert len(model.layers) == 10 and short.layers is not model.layers
    llama = build_hf("llama", layers=5)
    assert block_stack(llama)[0] == "model.layers"
    assert len(shallow_twin(llama, 2).model.layers) == 2 and len(llama.model.layers) == 5
    stack = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])
    assert block_stack(stack)[0] == "" and len(shallow_twin(stack, 3)) == 3
    assert shallow_twin(stack, 5) is None  # not deeper than asked
    assert block_stack(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))) is None  # not one kind


def test_the_whole_model_answers_when_twins_disagree_or_it_is_shallow():
    model = build_model("gpt", DEEP_GPT).module
    asked: list[int] = []

    def depth(module: nn.Module) -> int:
        asked.append(len(module.layers))
        return len(module.layers)

    assert twin_answer(model, depth) == 10 and asked == [2, 3, 10]
    asked.clear()
    assert twin_answer(model, lambda module: depth(module) > 1) is True and asked == [2, 3]
    asked.clear()
    shallow = build_model("gpt", DEEP_GPT.replace("layers=10", "layers=4")).module
    assert twin_answer(shallow, depth) == 4 and asked == [4]


def _pipeline_answer(model, inputs, loss_fn, monkeypatch, twins: bool):
    monkeypatch.setattr(twin, "MIN_BLOCKS_FOR_TWINS", 8 if twins else 10**6)
    return probes.pipeline_probe(model, inputs, loss_fn, _never_remember)


@pytest.mark.parametrize("family", ["zoo-gpt", "qwen2-default", "qwen2-hidden-states"])
def test_the_pipeline_probe_of_twins_is_the_whole_models(family, monkeypatch):
    if family == "zoo-gpt":
        spec = build_model("gpt", DEEP_GPT)
        model, inputs, loss_fn = spec.module, spec.example_inputs(1, 16), spec.loss_fn
    else:
        model = build_hf("qwen2-default", layers=8)
        model.config.output_hidden_states = family == "qwen2-hidden-states"  # one output per block
        inputs, loss_fn = hf_inputs("qwen2-default", 1), hf_loss
    import autopar.runtime.pipeline.schedule as schedule

    depths: list[int] = []
    capture = schedule.capture_program
    monkeypatch.setattr(schedule, "capture_program",
                        lambda module, *rest: depths.append(len(rest[-1])) or capture(module, *rest))
    whole = _pipeline_answer(model, inputs, loss_fn, monkeypatch, twins=False)
    assert depths == [len(block_stack(model)[1])]
    depths.clear()
    assert _pipeline_answer(model, inputs, loss_fn, monkeypatch, twins=True) == whole
    if family == "qwen2-hidden-states":  # the twins' outputs differ: the whole model was asked again
        assert depths == [2, 3, 8] and "hidden_states[8]" in whole.dropped_outputs
    else:
        assert depths == [2, 3] and whole.refusal is None
    if family == "qwen2-default":
        assert whole.training_settings == {"use_cache": False}


def test_the_tensor_parallel_probe_of_twins_is_the_whole_models(monkeypatch):
    """The module rules' probe at tp=2 (run them as priced?) answers the same on twins; it is the
    question that lets the search keep the static rules instead of dry-running every layout."""
    import autopar.runtime.tensor_parallel.realization as realization

    spec = build_model("gpt", DEEP_GPT)
    model, inputs = spec.module, spec.example_inputs(1, 16)
    graph = trace(model, inputs, loss_fn=spec.loss_fn, precision="bf16", name="gpt", seq_len=16)
    hints = model_hints(model)
    facts = model_facts(graph, heads=hints["heads"], kv_heads=hints["kv_heads"], vocab=hints["vocab"])
    cluster = load_cluster("dgx-h100", gpus=4)
    depths: list[int] = []
    run = realization.dry_run
    monkeypatch.setattr(realization, "dry_run", lambda module, *rest: depths.append(len(module.layers))
                        or run(module, *rest))
    answers = []
    for threshold in (10**6, 8):
        monkeypatch.setattr(twin, "MIN_BLOCKS_FOR_TWINS", threshold)
        table = probes.capabilities(model, inputs, spec.loss_fn, "bf16", graph, facts, cluster, {}, _never_remember)
        answers.append(table.tp_realization is None)  # None: the static module rules stand
    assert answers == [True, True] and depths == [10, 2, 3]
    assert len(model.layers) == 10  # the model was not cut


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_twin_graphs_from_the_capture_are_the_twins_traced(family):
    """The tp probe reads each twin's graph from the capture's own traced twin (`capture.TwinGraphs`)
    instead of tracing the twin again: every field of those graphs equals a trace of the twin; a
    module that is not a cut of this model gets None (and is traced)."""
    spec = build_model(family, DEEP_GPT)
    model, inputs = spec.module, spec.example_inputs(1, 16)
    options = dict(loss_fn=spec.loss_fn, precision="bf16", name=family, seq_len=16)
    graph, twins = trace_with_twins(model, inputs, **options)
    assert twins is not None and graph == trace(model, inputs, **options)
    for depth in (2, 3, 4, 9):
        short = shallow_twin(model, depth)
        assert twins.graph(short) == trace(short, inputs, **options), depth
    other = build_model(family, DEEP_GPT).module
    assert twins.graph(model) is None and twins.graph(shallow_twin(other, 3)) is None
    assert trace_with_twins(model, inputs, expand_repeats=False, **options)[1] is None


def test_the_tensor_parallel_probe_traces_no_twin_given_the_captures(monkeypatch):
    """With the capture's twin graphs the probe answers as before and traces nothing."""
    spec = build_model("gpt", DEEP_GPT)
    model, inputs = spec.module, spec.example_inputs(1, 16)
    graph, twins = trace_with_twins(model, inputs, loss_fn=spec.loss_fn, precision="bf16", name="gpt", seq_len=16)
    hints = model_hints(model)
    facts = model_facts(graph, heads=hints["heads"], kv_heads=hints["kv_heads"], vocab=hints["vocab"])
    cluster = load_cluster("dgx-h100", gpus=4)
    monkeypatch.setattr(twin, "MIN_BLOCKS_FOR_TWINS", 8)
    traced = []
    monkeypatch.setattr(probes, "trace", lambda module, *a, **k: traced.append(module) or trace(module, *a, **k))
    with_twins = probes.capabilities(model, inputs, spec.loss_fn, "bf16", graph, facts, cluster, {},
                                     _never_remember, twins)
    assert traced == []
    without = probes.capabilities(model, inputs, spec.loss_fn, "bf16", graph, facts, cluster, {}, _never_remember)
    assert [len(module.layers) for module in traced] == [2, 3]
    assert with_twins.tp_realization is None and without.tp_realization is None
