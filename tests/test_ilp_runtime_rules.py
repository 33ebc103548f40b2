"""The intra-op ILP offers only tp placements the runtime executes (`Capabilities.tp_rules`), so
`refine` keeps its proposals instead of refusing them all."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.capabilities import TpBlock, TpRules
from autopar.cluster import load_cluster
from autopar.graph import trace
from autopar.models import build_model
from autopar.cost_models.compute import DEFAULT_EFFICIENCY
from autopar.cost_models.facts import model_facts
from autopar.runtime.tensor_parallel.realization import capabilities_for
from autopar.searcher.intra_op import solve_unit
from autopar.searcher.intra_op_rules import equal, forbidden
from autopar.searcher.refiner import Refiner
from autopar.searcher.search import search
from autopar.searcher.tp_placements import one_each_proposal, planned_tp_placements

CLUSTER = load_cluster("dgx-h100", gpus=8)
GLOBAL_BATCH = 32
MODELS = {
    "tiny-gpt": ("gpt", "layers=2,hidden=64,heads=4,vocab=128,seq_len=32"),
    "tiny-llama": ("llama", "layers=2,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,vocab=128,seq_len=32"),
    # Layers large enough that the unrestricted ILP shards norms and splits biases from their weights.
    "wide-gpt": ("gpt", "layers=2,hidden=768,heads=12,vocab=4096,seq_len=1024"),
}
_built: dict[str, tuple] = {}


def built(label: str):
    """(graph, facts, module) of a model, traced once per session."""
    if label not in _built:
        family, overrides = MODELS[label]
        spec = build_model(family, overrides)
        config = spec.config
        graph = trace(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, precision="bf16", name=label,
                      seq_len=config.seq_len)
        facts = model_facts(graph, heads=config.heads, kv_heads=config.num_kv_heads, vocab=config.padded_vocab)
        _built[label] = graph, facts, spec.module
    return _built[label]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("label", list(MODELS))
def test_no_ilp_proposal_is_refused_and_every_proposal_runs(label, tp):
    graph, facts, module = built(label)
    capabilities = capabilities_for(module)
    result = search(graph, facts, CLUSTER, GLOBAL_BATCH, capabilities=capabilities, fixed={"tp": tp})
    assert result.ilp_variables > 0
    assert result.ilp_refused == 0
    # Each proposal, completed as `refine` completes it, passes the runtime's check.
    refiner = Refiner(graph, facts, CLUSTER, GLOBAL_BATCH, DEFAULT_EFFICIENCY, True, {"tp": tp}, capabilities)
    strategies = {c.strategy.model_copy(update={"sp": False}) for c in result.ranked}
    for strategy in sorted(strategies, key=lambda s: s.microbatch)[:2]:
        _, proposed = refiner.proposals(strategy)
        assert proposed
        for choice in one_each_proposal(proposed):
            planned = planned_tp_placements(choice, graph, facts, tp)
            assert capabilities.check_placements(planned) is None, (label, tp, strategy)


def test_without_the_rules_the_wide_layers_are_refused():
    """The case the rules exist for: unrestricted, every ILP proposal is one the runtime refuses."""
    graph, facts, module = built("wide-gpt")
    capabilities = dataclasses.replace(capabilities_for(module), tp_rules=None)
    # tp=4 (as below): at tp=2 the unrestricted ILP may keep these layers' norms and biases whole, and
    # then nothing is refused there; at tp=4 it splits them
    result = search(graph, facts, CLUSTER, GLOBAL_BATCH, capabilities=capabilities, fixed={"tp": 4})
    assert result.ilp_refused > 0


def test_a_bias_never_splits_while_its_weight_is_replicated():
    graph, facts, module = built("wide-gpt")
    layer = facts.units[facts.layer_units[0]]
    rules = capabilities_for(module).tp_rules

    def solve(tp_rules):  # tp=4, 64 samples: where the unrestricted ILP splits a bias (under the flat GEMM
        # efficiency; 32 samples did under the shape term)
        return solve_unit(layer, graph, tp=4, batch=64, cluster=CLUSTER, dtype=facts.precision,
                          tp_rules=tp_rules).param_placements

    def split_biases(placements):
        return [bias for bias, weight in rules.bias_follows.items()
                if placements.get(bias) == "S(0)" and placements.get(weight) != "S(0)"]

    assert split_biases(solve(None)), "the unrestricted ILP was expected to split a bias from its weight"
    restricted = solve(rules)
    assert not split_biases(restricted)
    for block in (b for b in rules.blocks if b.outputs[0] in restricted):  # this layer's blocks
        inputs = {restricted[name] for name in block.inputs}
        outputs = {restricted[name] for name in block.outputs}
        assert (inputs, outputs) in (({"R"}, {"R"}), ({"S(0)"}, {"S(1)"})), block
    assert all(restricted[name] in rules.allowed[name] for name in restricted)


def test_rules_agree_with_the_runtime_check():
    """Each block sharded alone runs; each single placement the rules exclude is refused."""
    graph, facts, module = built("tiny-gpt")
    capabilities = capabilities_for(module)
    rules = capabilities.tp_rules
    assert rules.allowed["embed.weight"] == rules.allowed["head.weight"] == ("R", "S(0)")  # tied to the head
    assert rules.allowed["layers.0.ln1.weight"] == ("R",)
    for block in rules.blocks:
        placements = {name: "S(0)" for name in block.inputs} | {name: "S(1)" for name in block.outputs}
        placements |= {bias: "S(0)" for bias, weight in rules.bias_follows.items() if placements.get(weight) == "S(0)"}
        assert capabilities.check_placements(placements) is None, block
    for name, allowed in rules.allowed.items():
        for placement in {"S(0)", "S(1)"} - set(allowed):
            assert capabilities.check_placements({name: placement}) is not None, (name, placement)


def test_rule_rows_skip_parameters_the_unit_lacks_and_find_tied_aliases():
    rules = TpRules(allowed={"a.weight": ("R", "S(0)"), "a.bias": ("R", "S(0)"), "b.weight": ("R", "S(1)"),
                             "emb.weight": ("R", "S(0)"), "head.weight": ("R", "S(0)"), "norm.weight": ("R",)},
                    bias_follows={"a.bias": "a.weight"},
                    blocks=(TpBlock(("a.weight", "missing.weight"), ("b.weight",)),),
                    tied=(("emb.weight", "head.weight"),))
    labels = {"a.weight": ["R", "S(0)", "S(1)"], "a.bias": ["R", "S(0)"], "b.weight": ["R", "S(0)", "S(1)"],
              "head.weight": ["R", "S(0)", "S(1)"], "norm.weight": ["R", "S(0)"]}
    assert set(forbidden(rules, labels)) == {("a.weight", "S(1)"), ("b.weight", "S(0)"), ("head.weight", "S(1)"),
                                             ("norm.weight", "S(0)")}
    assert equal(rules, labels) == [(("a.bias", "S(0)"), ("a.weight", "S(0)")),
                                    (("a.weight", "S(0)"), ("b.weight", "S(1)"))]
