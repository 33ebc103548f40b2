"""`CostCache`: a model's repeated layers (units equal but for their names) share cached costs, and
pricing with a shared cache gives exactly the numbers fresh caches give."""

from __future__ import annotations

import dataclasses

from autopar.cluster import load_cluster
from autopar.cost_models.evaluate import evaluate
from autopar.cost_models.stage_costs import CostCache
from autopar.plan_schema import Strategy


def test_repeated_layers_share_their_entries_and_nothing_else_does(gpt_512):
    _, facts = gpt_512
    layers = [unit for unit in facts.units if unit.layer_type is not None]
    first, second = layers[0], layers[1]
    assert first.name != second.name
    cache = CostCache()
    computed = []
    assert cache.get(first, ("k",), lambda: computed.append(first.name) or 1.0) == 1.0
    assert cache.get(second, ("k",), lambda: computed.append(second.name) or 2.0) == 1.0  # its twin's entry
    assert computed == [first.name] and cache.twin(second) is first

    ops = list(second.ops)
    heavy = next(i for i, op in enumerate(ops) if op.flops > 0)
    ops[heavy] = dataclasses.replace(ops[heavy], flops=ops[heavy].flops * 2)
    different = dataclasses.replace(second, ops=tuple(ops))
    assert cache.twin(different) is different
    assert cache.get(different, ("k",), lambda: 3.0) == 3.0
    others = [unit for unit in facts.units if unit.layer_type is None]
    assert all(cache.twin(unit) is unit for unit in others)  # the embedding and the head are their own


def test_a_shared_cache_prices_exactly_as_fresh_ones(gpt_512):
    _, facts = gpt_512
    cluster = load_cluster("dgx-h100", gpus=16)
    shared = CostCache()
    for strategy in (Strategy(dp=2, tp=2, pp=4, microbatch=1, num_microbatches=8, recompute="full"),
                     Strategy(dp=4, tp=4, pp=1, microbatch=2, num_microbatches=4, sp=True, recompute="selective"),
                     Strategy(dp=2, tp=1, pp=8, microbatch=1, num_microbatches=16, schedule="1f1b")):
        alone = evaluate(facts, cluster, strategy, 16, cache=CostCache())
        together = evaluate(facts, cluster, strategy, 16, cache=shared)
        assert together.step_time_s == alone.step_time_s
        assert [m.total_bytes for m in together.memory] == [m.total_bytes for m in alone.memory]
