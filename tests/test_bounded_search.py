"""The bounded quick ranking (`searcher.bounded`) gives the search exactly the answer the full ranking
gives (`search(..., exhaustive=True)`): the same best plan, ranked list, why-not rows, counts and
rejections, on small zoo models over pp/tp/dp/ZeRO/recompute/interleaved/zero-bubble choices, a MoE
model, a long sequence (cp offered), and a cluster where nothing fits (the offload pass). And the
floor it prices by (`cost_models.bounds`) is under every completion's quick step time."""

import pytest

from autopar.capabilities import RUNTIME_CAPABILITIES
from autopar.cluster import load_cluster
from autopar.cost_models.bounds import (FLOOR_FREE_KEYS, peak_memory_floor_bytes, quick_step_floor_s,
                                       rank_params_on_device)
from autopar.cost_models.evaluate import partition
from autopar.cost_models.pipeline import estimate, estimated_step_s
from autopar.cost_models.stage_costs import CostCache
from autopar.searcher.bounded import bounded_quick_evaluations
from autopar.searcher.candidates import evaluate_fitted, quick_evaluations, valid_strategies
from autopar.searcher.refiner import rank_key
from autopar.searcher.search import REFINE_TOP, search
from autopar.searcher.why_not import compared_groups

GPT = "layers=8,hidden=512,heads=8,vocab=4096,seq_len=256"
LLAMA = "layers=8,hidden=256,heads=8,kv_heads=2,vocab=4096,seq_len=256"
MOE = "layers=4,hidden=128,heads=4,kv_heads=2,vocab=512,seq_len=128,moe_experts=8,moe_top_k=2"
LONG = "layers=2,hidden=64,heads=8,kv_heads=8,vocab=96,seq_len=16384"


def _same_search(first, second) -> None:
    """Every field of two search results, evaluations compared exactly (floats bit for bit)."""
    assert (first.best is None) == (second.best is None)
    if first.best is not None:
        assert first.best.evaluation == second.best.evaluation
    assert len(first.ranked) == len(second.ranked)
    for a, b in zip(first.ranked, second.ranked):
        assert a.evaluation == b.evaluation
        assert [[u.name for u in stage] for stage in a.stages] == [[u.name for u in stage] for stage in b.stages]
        assert (a.op_placements, a.param_placements, a.tp_realization) == \
            (b.op_placements, b.param_placements, b.tp_realization)
    assert first.why_not == second.why_not
    assert (first.candidates, first.rejected) == (second.candidates, second.rejected)
    assert (first.without_offload, first.with_offload) == (second.without_offload, second.with_offload)


def _searched_both_ways(graph, facts, cluster, batch, **options):
    bounded = search(graph, facts, cluster, batch, **options)
    full = search(graph, facts, cluster, batch, exhaustive=True, **options)
    _same_search(bounded, full)
    return bounded


@pytest.mark.parametrize("family, config, gpus, batch", [
    ("gpt", GPT, 8, 32),  # pp/tp/dp, ZeRO, recompute, interleaved and zero-bubble schedules
    ("gpt", GPT, 64, 128),
    ("llama", LLAMA, 16, 64),  # grouped key/value heads
    ("llama", MOE, 8, 16),  # MoE: ep, and the expert-parallel why-not row
    ("llama", LONG, 8, 8),  # a long sequence: cp and its kinds, the cp why-not rows
])
def test_bounded_search_returns_what_the_full_ranking_returns(zoo_trace, family, config, gpus, batch):
    _, graph, facts = zoo_trace(family, config, batch=1)
    result = _searched_both_ways(graph, facts, load_cluster("dgx-h100", gpus=gpus), batch, use_ilp=False)
    assert result.best is not None and result.why_not


def test_bounded_search_with_the_ilp_and_fixed_keys(zoo_trace):
    _, graph, facts = zoo_trace("gpt", GPT, batch=1)
    cluster = load_cluster("dgx-a100-80gb", gpus=16)
    _searched_both_ways(graph, facts, cluster, 64)
    _searched_both_ways(graph, facts, cluster, 64, fixed={"pp": 2, "recompute": "selective"}, use_ilp=False)


@pytest.mark.parametrize("memory_bytes", [2**28, 2**31 + 2**26])
def test_bounded_search_when_little_or_nothing_fits(zoo_trace, memory_bytes):
    """GPUs too small for any plan (both rankings end in the closest plan, and the offload pass runs),
    and GPUs that fit a few plans, most of them with recompute."""
    _, graph, facts = zoo_trace("gpt", GPT, batch=1)
    cluster = load_cluster("dgx-h100", gpus=8)
    small = cluster.model_copy(update={"gpu": cluster.gpu.model_copy(update={"memory_bytes": memory_bytes})})
    result = _searched_both_ways(graph, facts, small, 32, use_ilp=False)
    if memory_bytes < 2**31:
        assert result.best is None and not result.ranked[0].evaluation.fits
    _searched_both_ways(graph, facts, small, 32, fixed={"offload": "none"}, use_ilp=False)


def test_bounded_ranking_skips_completions_and_keeps_the_top(zoo_trace):
    """On 64 GPUs most completions cannot rank: they are skipped, and the first REFINE_TOP are the full ranking's."""
    _, graph, facts = zoo_trace("gpt", GPT, batch=1)
    cluster = load_cluster("dgx-h100", gpus=64)
    supports = RUNTIME_CAPABILITIES.supports
    full, count, rejected = quick_evaluations(facts, cluster, {}, 128, layers=8, supports=supports)
    kept, kept_count, kept_rejected = bounded_quick_evaluations(
        facts, cluster, {}, 128, layers=8, rank_key=rank_key, keep=REFINE_TOP,
        groups=compared_groups(facts, cluster), supports=supports)
    assert (kept_count, kept_rejected) == (count, rejected)
    assert len(kept) < len(full) / 2
    assert sorted(kept, key=rank_key)[:REFINE_TOP] == sorted(full, key=rank_key)[:REFINE_TOP]


def test_floors_are_under_every_quick_step_and_peak_and_exact_without_the_terms_they_leave_out(zoo_trace):
    _, graph, facts = zoo_trace("gpt", GPT, batch=1)
    cluster = load_cluster("dgx-h100", gpus=8)
    cache = CostCache()
    strategies, _, _ = valid_strategies(facts, cluster, {}, 32, layers=8, supports=RUNTIME_CAPABILITIES.supports)
    exact = 0
    for s in strategies:
        stages = partition(facts, s.pp * s.vp)
        evaluation = evaluate_fitted(facts, cluster, s, 32, exact=False, cache=cache)
        floor = quick_step_floor_s(facts, cluster, s, stages=stages, cache=cache)
        assert floor == quick_step_floor_s(facts, cluster, s.model_copy(update=FLOOR_FREE_KEYS), stages=stages)
        assert floor <= evaluation.step_time_s
        params = rank_params_on_device(stages, s)
        assert peak_memory_floor_bytes(facts.precision, s, params) <= evaluation.peak_memory_bytes
        if s.tp == 1 and s.zero == 0 and s.recompute == "none":
            # nothing but compute in the stages once the weight passes are left out: the floor is the
            # pipeline estimate itself, bit for bit (and under it with them)
            passless = s.model_copy(update={"weight_passes": False})
            assert floor == evaluate_fitted(facts, cluster, passless, 32, exact=False).pipeline.step_time_s
            assert floor < evaluation.pipeline.step_time_s
            exact += 1
        if s.pp == 1:  # one rank holds every parameter once (a tied head shares the embedding's)
            assert params == [sum(unit.params_on_device(s.tp) for unit in facts.units)]
    assert exact > 10


@pytest.mark.parametrize("schedule, vp", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved_zb", 2),
                                          ("zbv", 2)])
def test_estimated_step_is_the_estimates_step(schedule, vp):
    forward, backward, weight = [1.0, 2.0, 1.5, 1.0], [2.0, 4.5, 3.0, 2.0], [1.0, 2.0, 1.0, 0.5]
    pp = 4 // vp
    full = estimate(forward, backward, 8, schedule, pp=pp, vp=vp, p2p_s=0.25, weight_s=weight)
    assert estimated_step_s(forward, backward, 8, schedule, pp=pp, vp=vp, p2p_s=0.25, weight_s=weight) \
        == full.step_time_s
    if schedule == "1f1b":  # closed form: m·slowest rank + (pp-1)·average rank + 2(pp-1) transfers
        assert full.step_time_s == pytest.approx(8 * 6.5 + 3 * (3 + 6.5 + 4.5 + 3) / 4 + 2 * 3 * 0.25)


def test_kept_sequence_shards_are_chosen_where_memory_binds(zoo_trace):
    """Keeping sequence shards (`sp_inputs=regathered`) sends one more all-gather per block and keeps less:
    the search prices it where memory binds, both rankings alike, and there it fits a larger micro-batch
    than keeping the gathered inputs does; with room to spare it is not chosen."""
    _, graph, facts = zoo_trace("gpt", "layers=8,hidden=1024,heads=8,vocab=4096,seq_len=2048", batch=1)
    cluster = load_cluster("dgx-h100", gpus=8)
    fixed = {"tp": 4, "sp": True, "recompute": "none"}
    small = cluster.model_copy(update={"gpu": cluster.gpu.model_copy(update={"memory_bytes": 4 * 2**30})})
    kept = _searched_both_ways(graph, facts, small, 32, fixed=fixed, use_ilp=False).best.evaluation
    gathered = search(graph, facts, small, 32, fixed={**fixed, "sp_inputs": "gathered"}, use_ilp=False).best.evaluation
    assert kept.strategy.sp_inputs == "regathered" and gathered.strategy.sp_inputs == "gathered"
    assert kept.strategy.microbatch > gathered.strategy.microbatch
    assert kept.step_time_s < gathered.step_time_s
    roomy = search(graph, facts, cluster, 32, fixed=fixed, use_ilp=False).best.evaluation
    assert roomy.strategy.sp_inputs == "gathered"
