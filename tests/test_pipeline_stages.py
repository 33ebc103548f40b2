"""Pipeline stages wherever the repeated blocks sit: Hugging Face models through the public path
(trace → search under the runtime's capabilities → build_plan → autopar.parallelize).

Parity as in test_runtime_parity: every loss matches one process to relative 1e-5, the gathered
final weights to 1e-5, and each rank's collectives in a step (pp send/recv of every tensor that
crosses a cut included) are those the plan predicted.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hf_tiny
from parity_harness import plan_for, run_plans, train_parallel, train_reference

pytest.importorskip("transformers")

STEPS = 4
GLOBAL_BATCH = 8


def hf_plan(family: str, strategy: dict, world: int):
    model = hf_tiny.build(family)
    heads, kv_heads = hf_tiny.heads(family)
    return plan_for(model, hf_tiny.example_inputs(family, 1), hf_tiny.loss_fn, name=f"tiny-{family}",
                    seq_len=hf_tiny.SEQ, heads=heads, kv_heads=kv_heads, vocab=hf_tiny.VOCAB, strategy=strategy,
                    world=world, global_batch=GLOBAL_BATCH)


def run_job(job: dict) -> dict:
    from autopar.plan_schema import Plan

    return train_parallel(hf_tiny.build(job["family"]), hf_tiny.loss_fn, Plan.from_json(job["plan"]), job["data"])


def _parity(cases: list[tuple[str, dict]], world: int) -> None:
    from test_runtime_parity import _check

    plans = [hf_plan(family, strategy, world) for family, strategy in cases]
    data = {family: hf_tiny.data(family, GLOBAL_BATCH, STEPS) for family, _ in cases}
    jobs = [dict(plan=plan.to_json(), family=family, data=data[family]) for (family, _), plan in zip(cases, plans)]
    results = run_plans(world, jobs, runner=run_job)
    references = {family: train_reference(copy.deepcopy(hf_tiny.build(family)), hf_tiny.loss_fn, data[family])
                  for family in data}
    for (family, strategy), plan, ranks in zip(cases, plans, results):
        _check({"model": family, **strategy}, plan, ranks, *references[family])


CAUSAL_WORLD2 = [
    ("llama", dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2)),
    ("llama", dict(dp=1, tp=1, pp=2, schedule="interleaved", vp=2, microbatch=2)),
    ("llama", dict(dp=1, tp=1, pp=2, schedule="gpipe", microbatch=2, recompute="full")),
    ("gpt2", dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2)),
    ("gpt2", dict(dp=1, tp=1, pp=2, schedule="interleaved", vp=2, microbatch=1)),
]


def test_causal_lms_1f1b_and_interleaved():
    """`model.layers.N` inside LlamaModel (also recomputed: the layer's keyword inputs pass through
    the checkpoint), `transformer.h.N` inside GPT2Model (its embedding tied to the head on the other
    pipeline rank: their gradients summed)."""
    _parity(CAUSAL_WORLD2, world=2)


OTHER_WORLD2 = [
    ("bert", dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2)),
    ("t5", dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2)),
    ("bart", dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2)),
    ("vit", dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2)),
]


def test_masked_lm_encoder_decoders_and_a_vision_transformer():
    """BERT's masked LM (decoder weight and bias tied across stages); T5 and BART: the encoder's
    output crosses to the decoder's stages (T5 also hands its relative position bias down each
    stack); ViT: patch embeddings, then the layers of `vit.encoder`."""
    _parity(OTHER_WORLD2, world=2)


DEFAULT_CONFIGS_WORLD2 = [
    ("qwen2-default", dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2)),
    ("bart-default", dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2)),
]


def test_hugging_face_models_with_their_default_configs():
    """A causal LM and an encoder-decoder as Hugging Face builds them (use_cache=True, the default
    attention): the stages capture the forward with use_cache=False, which the plan records, and
    train with parity and the planned ledger; the user's config is left as it was."""
    for family, strategy in DEFAULT_CONFIGS_WORLD2:
        plan = hf_plan(family, strategy, 2)
        assert plan.pipeline_capture is not None, family
        assert plan.pipeline_capture.training_settings == {"use_cache": False}, plan.pipeline_capture
        model = hf_tiny.build(family)
        assert all(module.config.use_cache for module in model.modules() if hasattr(module, "config")), family
    _parity(DEFAULT_CONFIGS_WORLD2, world=2)


def test_the_plan_names_outputs_the_loss_does_not_read():
    """Hidden states asked for by the config are output leaves no loss reads: the plan lists them as
    not carried, and a model whose loss reads them all drops nothing."""
    import autopar

    model = hf_tiny.build("qwen2-default")
    model.config.output_hidden_states = True
    heads, kv_heads = hf_tiny.heads("qwen2-default")
    result = autopar.plan(model, hf_tiny.example_inputs("qwen2-default", 1), cluster=autopar.load_cluster("dgx-h100", gpus=2),
                          global_batch=GLOBAL_BATCH, strategy=dict(dp=1, tp=1, pp=2, microbatch=2),
                          loss_fn=hf_tiny.loss_fn, precision="fp32", seq_len=hf_tiny.SEQ, heads=heads,
                          kv_heads=kv_heads, vocab=hf_tiny.VOCAB, use_ilp=False)
    capture = result.plan.pipeline_capture
    assert capture.dropped_outputs == [f"hidden_states[{i}]" for i in range(5)], capture
    assert any("not carried: hidden_states[0]" in note for note in result.notes), result.notes


WORLD4 = [
    ("llama", dict(dp=2, tp=1, pp=2, schedule="1f1b", zero=0, microbatch=1)),
    ("gpt2", dict(dp=2, tp=1, pp=2, schedule="gpipe", zero=1, microbatch=1)),
    ("llama", dict(dp=1, tp=2, pp=2, schedule="1f1b", microbatch=2)),
    ("llama", dict(dp=1, tp=2, pp=2, sp=True, schedule="interleaved", vp=2, microbatch=2)),
]


# ~40 s on 4 processes; pp x tp on the zoo Llama stays in the default set (test_runtime_parity).
@pytest.mark.slow
def test_pipeline_with_data_and_tensor_parallel_world4():
    """pp x dp (ZeRO 0 and 1), and pp x tp (with and without sequence parallelism): the runtime's
    tensor parallelism wraps the model's own modules inside each stage."""
    _parity(WORLD4, world=4)


def _cut(family: str, strategy: dict, world: int = 2):
    """The plan and the runtime's cut of `family`'s forward into its stages, on one process."""
    from autopar.runtime.pipeline.schedule import cut_pipeline, microbatch_inputs

    plan = hf_plan(family, strategy, world)
    model = hf_tiny.build(family)
    return plan, model, cut_pipeline(model, plan, microbatch_inputs(plan, None), hf_tiny.loss_fn)


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_stages_keep_the_models_names_and_compute_its_forward(family):
    """Chained on one process, the stages hold every parameter under the model's own names and
    compute exactly what the model computes (the captured code between modules is the model's)."""
    from torch.utils import _pytree as pytree

    plan, model, cut = _cut(family, dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2))
    stages = [cut.stage_module(model, index, torch.device("cpu")) for index in range(len(plan.stages))]
    names = {name for stage in stages for name, _ in stage.named_parameters(remove_duplicate=False)}
    assert names <= {name for name, _ in model.named_parameters(remove_duplicate=False)}
    assert {id(p) for name, p in model.named_parameters(remove_duplicate=False) if name in names} == \
        {id(p) for p in model.parameters()}
    inputs = hf_tiny.data(family, 2, 1)[0]
    carried = ()
    for stage in stages:
        carried = stage(*carried, input_0=inputs)
    slots = cut.split.stages[-1].output_slots
    leaves = [None] * len(next(n for n in cut.program.graph.nodes if n.op == "output").args[0])
    for slot, value in zip(slots, carried):
        leaves[slot] = value
    output = pytree.tree_unflatten(leaves, cut.program.out_spec)
    torch.testing.assert_close(output.logits, model(inputs).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family, strategy", [
    ("t5", dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2)),
    ("bart", dict(dp=1, tp=1, pp=4, schedule="1f1b", microbatch=2)),
])
def test_what_crosses_each_cut_is_what_the_plan_prices(family, strategy):
    """The tensors the runtime sends at each cut (from its captured program) are the cost model's
    `Unit.cut` for that cut (from the op graph): the same count, bytes and gradients."""
    from autopar.cost_models.facts import model_facts
    from autopar.graph import trace

    plan, model, cut = _cut(family, strategy, world=strategy["pp"])
    heads, kv_heads = hf_tiny.heads(family)
    graph = trace(model, hf_tiny.example_inputs(family, 1), loss_fn=hf_tiny.loss_fn, name=family, seq_len=hf_tiny.SEQ)
    units = {unit.name: unit for unit in model_facts(graph, heads=heads, kv_heads=kv_heads, vocab=hf_tiny.VOCAB).units}
    b = plan.strategy.microbatch
    for stage, sent in zip(plan.stages[1:], cut.split.crossing):
        executed = sorted((node.meta["val"].numel() * node.meta["val"].element_size(),
                           node.meta["val"].is_floating_point()) for node in sent)
        priced = sorted((tensor.bytes_for(b), tensor.grad) for tensor in units[stage.units[0]].cut)
        assert executed == priced, (stage.units[0], executed, priced)
        assert executed, "a cut sends something"


class StepCounting(torch.nn.Module):
    """Repeated blocks, and a forward that counts its calls in a buffer of the root: state that
    stages recomputing the code between blocks would drop or repeat."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


class AsksForCache(torch.nn.Module):
    """A wrapper whose own code asks the inner causal LM for its KV cache: no setting can turn that off."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor):
        return self.inner(input_ids=ids, use_cache=True)


def _mean_square(output, inputs):
    return output.pow(2).mean()


def _capabilities(model, inputs):
    import dataclasses

    from autopar.runtime.pipeline.schedule import pipeline_refusal
    from autopar.runtime.tensor_parallel.realization import capabilities_for

    return dataclasses.replace(capabilities_for(model), pipeline_refusal=pipeline_refusal(model, inputs))


@pytest.mark.parametrize("case, reason", [
    ("counting", "writes into steps outside the modules pipeline stages call"),
    ("kv-cache", "DynamicCache.*asks for an inference cache itself"),
])
def test_a_forward_that_cannot_be_cut_gets_no_pipeline_plan(case, reason):
    """The cut is tried on the model's inputs (on meta): a failure is the searcher's reason, asked
    for pp it names it, left free it offers no pp > 1."""
    import re

    from autopar.cluster import load_cluster
    from autopar.cost_models.facts import model_facts
    from autopar.errors import AutoparError
    from autopar.graph import trace
    from autopar.searcher.search import search

    if case == "counting":
        model, inputs, loss = StepCounting(), (torch.zeros(1, 8),), _mean_square
    else:
        inputs, loss = hf_tiny.example_inputs("llama", 1), hf_tiny.loss_fn
        model = AsksForCache(hf_tiny.build("llama"))  # with the config's use_cache=True alone, the cut works
    capabilities = _capabilities(model, inputs)
    assert capabilities.pipeline_refusal and re.search(reason, capabilities.pipeline_refusal), \
        capabilities.pipeline_refusal
    graph = trace(model, inputs, loss_fn=loss, name=case)
    facts = model_facts(graph, heads=4, kv_heads=2, vocab=hf_tiny.VOCAB)
    cluster = load_cluster("dgx-h100", gpus=4)
    with pytest.raises(AutoparError, match=reason):
        search(graph, facts, cluster, 8, fixed=dict(pp=2), use_ilp=False, capabilities=capabilities)
    result = search(graph, facts, cluster, 8, use_ilp=False, capabilities=capabilities)
    assert any(re.search(reason, why) for why in result.rejected), result.rejected
    assert all(candidate.strategy.pp == 1 for candidate in result.ranked)


def test_a_forged_pipeline_plan_is_refused_before_any_collective():
    """A plan that bypassed the searcher: parallelize tries the cut first and says why in one line
    (no process group is even needed to get there)."""
    from autopar.errors import AutoparError
    from autopar.runtime.parallelize import parallelize

    model = StepCounting()
    plan = plan_for(model, (torch.zeros(1, 8),), _mean_square, name="counting", seq_len=1, heads=1, kv_heads=1,
                    vocab=8, strategy=dict(dp=2, tp=1, pp=1, zero=0, microbatch=2), world=2, global_batch=8)
    forged = plan.model_copy(update={"strategy": plan.strategy.model_copy(update={"dp": 1, "pp": 2})})
    with pytest.raises(AutoparError, match="writes into steps outside the modules pipeline stages call"):
        parallelize(StepCounting(), forged, loss_fn=_mean_square)


def test_the_searcher_offers_pipeline_stages_for_hugging_face_models():
    """Nothing refuses pp for a model whose forward can be cut: left free on 4 GPUs, the search
    ranks pipeline candidates for a Llama (nested `model.layers.N`) and an encoder-decoder."""
    from autopar.cluster import load_cluster
    from autopar.cost_models.facts import model_facts
    from autopar.graph import trace
    from autopar.searcher.search import search

    for family in ("llama", "t5"):
        model, inputs = hf_tiny.build(family), hf_tiny.example_inputs(family, 1)
        capabilities = _capabilities(model, inputs)
        assert capabilities.pipeline_refusal is None
        graph = trace(model, inputs, loss_fn=hf_tiny.loss_fn, name=family, seq_len=hf_tiny.SEQ)
        heads, kv_heads = hf_tiny.heads(family)
        facts = model_facts(graph, heads=heads, kv_heads=kv_heads, vocab=hf_tiny.VOCAB)
        result = search(graph, facts, load_cluster("dgx-h100", gpus=4), 8, use_ilp=False, capabilities=capabilities)
        assert any(candidate.strategy.pp > 1 for candidate in result.ranked), family
